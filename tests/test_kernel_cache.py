"""The compiled-kernel cache as a trust boundary (`reap.quant.ckernel`): a library is loaded only
from a private directory, when it is ours, others cannot write it and its bytes match the
sha256 recorded at build time; anything else is built again, never loaded (checked by the next
process, as the next `reap` command would find the cache). `CC` and `CFLAGS`
are honoured; without a compiler stderr says once that the kernels are off, and the torch paths
give the results."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from reap.models.shared import blocks
from reap.quant import ckernel, dense_kernel, mxfp4, step_kernel
from reap.quant.mxfp4_decode import decode_mxfp4

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")

EVIL = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(MARKER, "w");
    if (f) { fputs("ran", f); fclose(f); }
}
void reap_f32_linear(void) {}
"""


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A fresh cache directory and a loader that has loaded nothing yet."""
    monkeypatch.setenv("REAP_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("CFLAGS", raising=False)
    monkeypatch.delenv("REAP_NO_CKERNEL", raising=False)
    for name, fresh in (("_LOADED", {}), ("_SAID", set()), ("_TEMP", [])):
        monkeypatch.setattr(ckernel, name, fresh, raising=False)
    return tmp_path / "cache" / "kernels"


ROOT = Path(__file__).resolve().parents[1]
CHECK = """import torch
from reap.quant import dense_kernel as d
w, x = torch.randn(40, 64), torch.randn(2, 64)
with d.enabled():
    print(d.library() is not None and torch.allclose(d.dense_linear(x, w), x @ w.T, atol=1e-4))
"""


def _next_run() -> tuple[bool, str]:
    """What the next reap process finds: whether the dense kernel loads and computes x @ w.T,
    and its stderr."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.run(["python", "-c", CHECK], env=env, cwd=ROOT, capture_output=True, check=False,
                       text=True, timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stderr
    return p.stdout.strip() == "True", p.stderr


def _planted(tmp_path: Path) -> tuple[Path, Path]:
    """A library whose constructor writes a marker file, and that marker's path."""
    marker, src = tmp_path / "marker", tmp_path / "evil.c"
    src.write_text(EVIL)
    so = tmp_path / "evil.so"
    subprocess.run(["cc", "-shared", "-fPIC", f'-DMARKER="{marker}"', "-o", so, src], check=True)
    return so, marker


def _plant(evil: Path, so: Path, record: bool) -> None:
    """Put `evil` at `so`'s name (and, with `record`, its sha256 as the record beside it)."""
    so.unlink()  # a new file: this process maps the old one
    shutil.copyfile(evil, so)
    if record:
        Path(f"{so}.sha256").write_text(hashlib.sha256(evil.read_bytes()).hexdigest() + "\n")


def test_a_replaced_library_is_not_loaded(cache, tmp_path):
    """A library whose bytes are not the ones recorded at build time (here: another library
    with a constructor) is built again, its constructor never runs."""
    assert dense_kernel.library() is not None
    (so,) = cache.glob("dense-*.so")
    assert (cache.stat().st_mode & 0o777) == 0o700
    assert Path(f"{so}.sha256").read_text().strip() == hashlib.sha256(so.read_bytes()).hexdigest()
    evil, marker = _planted(tmp_path)
    _plant(evil, so, record=False)
    works, _ = _next_run()
    assert not marker.exists(), "the replaced library was loaded"
    assert works and so.read_bytes() != evil.read_bytes()  # built again in its place


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o722])
def test_a_cache_directory_others_can_write_is_not_used(cache, tmp_path, mode):
    """Where group or others can write the cache directory, what it holds is not trusted, even
    with a matching record: the kernels are built in a private temporary directory instead."""
    assert dense_kernel.library() is not None
    (so,) = cache.glob("dense-*.so")
    evil, marker = _planted(tmp_path)
    _plant(evil, so, record=True)
    cache.chmod(mode)
    works, err = _next_run()
    assert not marker.exists(), "a library from a shared directory was loaded"
    assert works and err.count("reap: warning: kernel cache") == 1 and str(cache) in err


@pytest.mark.parametrize("what", ["file", "directory"])
def test_files_of_another_user_are_not_loaded(cache, tmp_path, what):
    """A library (with its record) or a cache directory owned by another user is not used: the
    file is built again in its place, the directory passed over."""
    if os.getuid() != 0:
        pytest.skip("only root can give a file to another user")
    assert dense_kernel.library() is not None
    (so,) = cache.glob("dense-*.so")
    evil, marker = _planted(tmp_path)
    _plant(evil, so, record=True)
    for p in (so, Path(f"{so}.sha256")) if what == "file" else (cache,):
        os.chown(p, 65534, 65534)  # nobody
    works, _ = _next_run()
    assert not marker.exists(), "another user's library was loaded"
    assert works
    if what == "file":
        assert so.stat().st_uid == 0 and so.read_bytes() != evil.read_bytes()


def test_cc_and_cflags_are_honoured(cache, tmp_path, monkeypatch):
    """`CC` (a command with arguments, split as a shell would) compiles, with `CFLAGS` after
    reap's own flags; a changed CFLAGS is another library."""
    log, wrapper = tmp_path / "cc.log", tmp_path / "my cc"
    wrapper.write_text(f'#!/bin/sh\necho "$@" >> "{log}"\nexec cc "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", f"'{wrapper}' -DFROM_CC=1")
    monkeypatch.setenv("CFLAGS", "-DFROM_CFLAGS=1 -O2")
    assert dense_kernel.library() is not None
    (line,) = log.read_text().splitlines()
    args = line.split()
    assert args[0] == "-DFROM_CC=1" and args.index("-O3") < args.index("-DFROM_CFLAGS=1")
    assert args.index("-DFROM_CFLAGS=1") < args.index("-O2")
    monkeypatch.setenv("CFLAGS", "-DFROM_CFLAGS=2")
    assert _next_run()[0]
    builds = [c for c in log.read_text().splitlines() if "dense_kernels.c" in c]
    assert len(builds) == 2 and len(list(cache.glob("dense-*.so"))) == 2


def test_without_a_compiler_one_warning_and_the_torch_results(cache, monkeypatch, capfd):
    """No compiler: every library is unavailable, stderr says once what that costs, and the
    decode and the products are torch's."""
    monkeypatch.setenv("CC", "/nonexistent/cc")
    libs = (ckernel.library, dense_kernel.library, step_kernel.library, ckernel.library)
    assert all(library() is None for library in libs)
    err = capfd.readouterr().err.splitlines()
    assert len(err) == 1, err
    assert "compiled kernels off, no C compiler" in err[0] and "0.37x" in err[0]
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (8, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(120, 130, (8, 1), dtype=torch.uint8, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        want = mxfp4.dequantize(packed, scales, dtype)
        assert torch.equal(decode_mxfp4(packed, scales, dtype), want)
    w, x = torch.randn(12, 32, generator=g), torch.randn(2, 32, generator=g)
    with dense_kernel.enabled():
        assert not dense_kernel.usable(x, w)
        assert torch.equal(blocks.linear(x, w), blocks.linear_reference(x, w))
    assert capfd.readouterr().err == ""
