"""Fast subset of the kernel-cache and INT4/fused-view harnesses (experiments/fuzz_kernels.py,
experiments/fuzz_views.py; issue 34 part 8), through the public CLI in fresh processes.

Kernel cache: a library replaced by one whose constructor writes a marker (the marker must
never appear), a cache directory others can write holding recorded foreign code, no compiler on
PATH (one warning, the reference tokens), and the cases the harness found: a FIFO at a cached
library's name (blocked `open()` forever), a symlink there (the run stopped with exit 2), an
unbalanced quote in CC or CFLAGS (exit 1, "forward failed: No closing quotation"). Each must
end with exit 0 and the reference tokens. Views: NaN, 1e38 and wrong shapes in INT4 and fused
GPT-OSS experts and a NaN E8M0 scale byte in a fused MXFP4 one (its line said `gate_up`, not
the tensor), refused naming the tensor by every command that reads them.
"""

import shutil

import pytest

from experiments import fuzz_kernels, fuzz_views

KERNEL_TRIALS = [
    "replaced_so",
    "dir_mode_777",
    "no_compiler_on_path",
    "so_fifo",
    "so_symlink_to_evil",
    "cc_unbalanced_quote",
    "cflags_unbalanced_quote",
]
VIEW_CASES = [
    "mxfp4/scale_byte_255",
    "int4/scale_1e38",
    "int4/packed_cols_minus_1",
    "int4/shape_swapped",
    "fused/weight_nan",
    "fused/weight_experts_minus_1",
]


@pytest.fixture(scope="module")
def kernel_records(tmp_path_factory):
    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    work = tmp_path_factory.mktemp("kernels")
    only = [f"{t}" for t in KERNEL_TRIALS]
    records = fuzz_kernels.execute(work, timeout=30.0, only=only)
    return {r["trial"]: r for r in records}


@pytest.mark.parametrize("trial", KERNEL_TRIALS)
def test_kernel_cache_trial_is_clean(kernel_records, trial):
    rec = kernel_records[trial]
    assert rec["verdict"] == "clean", f"{trial}: {rec['verdict']} (exit {rec['rc']}): {rec}"


def test_no_compiler_says_so_once(kernel_records):
    (warning,) = kernel_records["no_compiler_on_path"]["warnings"]
    assert "compiled kernels off, no C compiler" in warning and "0.37x" in warning


@pytest.fixture(scope="module")
def view_records(tmp_path_factory):
    work = tmp_path_factory.mktemp("views")
    return {r["key"]: r for r in fuzz_views.execute(work, timeout=30.0, only=VIEW_CASES)}


@pytest.mark.parametrize("case", VIEW_CASES)
def test_a_corrupted_view_is_refused_by_every_command(view_records, case):
    for command in fuzz_views.COMMANDS:
        rec = view_records[f"{case}/{command}"]
        assert rec["verdict"] == "clean", (
            f"{rec['key']}: {rec['verdict']} {rec['note']}: {rec['line']}"
        )
        if rec["expect"] == "reject":  # 2, 4, or 1 for a binding failure (the verdict's rule)
            assert rec["rc"] in (1, 2, 4), rec
