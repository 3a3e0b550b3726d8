"""The compiled many-token expert call (`reap.engine.native.NativeDecoder.moe_call`, the routed
experts of a prefill chunk in one library call) against the torch path's expert-major dispatch
(`blocks.dispatch_reference` over `blocks.silu_glu`), side by side in one run, on one thread:
64 random experts top-8, hidden 1024, expert width 384 (the 1 B model of
`experiments/bench_llamacpp.py`), fp32 and bf16 weights, at several chunk sizes (tokens per
expert = 8 x tokens / 64). Each pair is checked to agree before it is timed. This is where
`reap.quant.step_kernel.BF16_ROWS` comes from: in bf16 torch's matmul (the CPU's bf16
dot-product instructions) overtakes the library's fp32-FMA tiles as chunks grow.

    python -m experiments.bench_step_kernels [--reps 3]   # reports/step-kernels.{md,json}

`--against REV` times the library built from git revision REV's kernel sources instead of
the torch dispatch, in the same run and process (a kernel change measured against the code
before it; both must give the same bits); `--hidden 2048` is the big model's width.

    python -m experiments.bench_step_kernels --against HEAD~1 --hidden 2048 \
        --out reports/step-kernels-avx2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from experiments.bench_llamacpp import cpu
from reap.engine import native
from reap.fileio import write_atomic
from reap.models.shared import blocks
from reap.provenance import code_version
from reap.quant import step_kernel

ROOT = Path(__file__).resolve().parent.parent
E, K, F = 64, 8, 384
TOKENS = (32, 64, 128, 256, 512)


def _decoder(lib, dtype: torch.dtype):
    nd = native.NativeDecoder.__new__(native.NativeDecoder)  # only the library call is used
    nd.lib, nd.wbf16 = lib, dtype == torch.bfloat16
    nd.rnd = nd.wbf16
    return nd


def _setup(dtype: torch.dtype, n: int, D: int, other=None):
    """(library call, reference call): the reference is the torch dispatch, or with `other` (a
    library) the same call into that build."""
    g = torch.Generator().manual_seed(n)
    ws = [[(torch.randn(*s, generator=g) / 30).to(dtype) for s in ((F, D), (F, D), (D, F))]
          for _ in range(E)]  # fmt: skip
    x = torch.randn(n, D, generator=g).to(dtype)
    ids, weights, _ = blocks.softmax_topk(torch.randn(n, E, generator=g), K, True)
    table = torch.tensor([[w.data_ptr() for w in ws[e]] for e in range(E)])
    nd = _decoder(step_kernel.library(), dtype)
    lib_call = lambda ws=ws: nd.moe_call(x, ids, weights, table, F)  # table points into ws
    if other is not None:
        od = _decoder(other, dtype)
        return lib_call, lambda: od.moe_call(x, ids, weights, table, F)
    ref_call = lambda: blocks.dispatch_reference(
        x, ids, weights, lambda e, xs: blocks.silu_glu(xs, *ws[e])
    )[0]
    return lib_call, ref_call


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def build_at(rev: str):
    """The step library built from git revision `rev`'s kernel sources."""
    tmp = Path(tempfile.mkdtemp(prefix="reap-kernels-"))
    git = ["git", "-C", str(ROOT)]
    ls = [*git, "ls-tree", "--name-only", f"{rev}:reap/quant"]
    for name in subprocess.run(ls, check=True, capture_output=True, text=True).stdout.split():
        if name.endswith((".c", ".h")):
            show = [*git, "show", f"{rev}:reap/quant/{name}"]
            (tmp / name).write_text(subprocess.run(show, check=True, capture_output=True,
                                                   text=True).stdout)  # fmt: skip
    lib = step_kernel.library(where=tmp)
    if lib is None:
        raise SystemExit(f"the step kernels of {rev} could not be built")
    return lib


def measure(reps: int, D: int, other=None) -> list[dict]:
    """Per dtype and chunk size: the library's and the reference's GFLOP/s (medians of `reps`
    alternating calls after one untimed call of each) and their ratio."""
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for n in TOKENS:
            lib_call, ref_call = _setup(dtype, n, D, other)
            got, want = lib_call(), ref_call()  # first use of each shape out of the timing
            if other is not None:  # one order of operations in every version
                assert torch.equal(got, want), "the two builds give different values"
            else:
                tol = 1e-4 if dtype == torch.float32 else 5e-2
                torch.testing.assert_close(got, want, atol=tol, rtol=tol)
            times = [(_seconds(lib_call), _seconds(ref_call)) for _ in range(reps)]
            lib, ref = (statistics.median(t) for t in zip(*times))
            flop = n * K * 3 * F * D * 2
            row = {"dtype": str(dtype).removeprefix("torch."), "tokens": n,
                   "tokens_per_expert": n * K / E, "library_gflops": flop / lib / 1e9,
                   "reference_gflops": flop / ref / 1e9, "ratio": ref / lib}  # fmt: skip
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def report(rows: list[dict], args, minutes: float) -> str:
    ref = f"the library of {args.against}" if args.against else "the torch dispatch"
    base = args.against or "torch"
    out = [
        f"# Many-token expert call: the library vs {ref}",
        "",
        (
            f"Command: `python -m experiments.bench_step_kernels {' '.join(sys.argv[1:])}` "
            f"({minutes:.1f} min; code {code_version()}; one torch thread, one pool thread). "
            f"CPU: {cpu()}. {E} random experts top-{K}, hidden {args.hidden}, expert width {F}; "
            f"medians of {args.reps} alternating calls after one untimed call of each."
        ),
        "",
        f"| dtype | tokens | tokens per expert | library GFLOP/s | {base} GFLOP/s | speed-up |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(f"| {r['dtype']} | {r['tokens']} | {r['tokens_per_expert']:.0f} | "
                   f"{r['library_gflops']:.0f} | {r['reference_gflops']:.0f} | "
                   f"**{r['ratio']:.2f}** |")  # fmt: skip
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=1024, help="model width (1b: 1024, big: 2048)")
    ap.add_argument("--against", help="a git revision: time its kernels instead of torch's")
    ap.add_argument("--out", default="reports/step-kernels", help="report path without suffix")
    args = ap.parse_args()
    if step_kernel.library() is None:
        raise SystemExit("the step kernels could not be built (no C compiler?)")
    other = build_at(args.against) if args.against else None
    torch.set_num_threads(1)
    t0 = time.time()
    rows = measure(args.reps, args.hidden, other)
    minutes = (time.time() - t0) / 60
    out = ROOT / args.out
    write_atomic(out.with_suffix(".md"), report(rows, args, minutes))
    res = {"code_version": code_version(), "against": args.against, "hidden": args.hidden,
           "reps": args.reps, "minutes": minutes, "rows": rows}  # fmt: skip
    write_atomic(out.with_suffix(".json"), json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
