"""The compiled many-token expert call (`reap.engine.native.NativeDecoder._moe_call`, the routed
experts of a prefill chunk in one library call) against the torch path's expert-major dispatch
(`blocks.dispatch_reference` over `blocks.silu_glu`), side by side in one run, on one thread:
64 random experts top-8, hidden 1024, expert width 384 (the 1 B model of
`experiments/bench_llamacpp.py`), fp32 and bf16 weights, at several chunk sizes (tokens per
expert = 8 x tokens / 64). Each pair is checked to agree before it is timed. This is where
`reap.quant.step_kernel.BF16_ROWS` comes from: in bf16 torch's matmul (the CPU's bf16
dot-product instructions) overtakes the library's fp32-FMA tiles as chunks grow.

    python -m experiments.bench_step_kernels [--reps 3]   # reports/step-kernels.{md,json}
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from reap.engine import native
from reap.fileio import write_atomic
from reap.models import blocks
from reap.provenance import code_version
from reap.quant import step_kernel

ROOT = Path(__file__).resolve().parent.parent
E, K, D, F = 64, 8, 1024, 384
TOKENS = (32, 64, 128, 256, 512)


def _setup(dtype: torch.dtype, n: int):
    g = torch.Generator().manual_seed(n)
    ws = [[(torch.randn(*s, generator=g) / 30).to(dtype) for s in ((F, D), (F, D), (D, F))]
          for _ in range(E)]  # fmt: skip
    x = torch.randn(n, D, generator=g).to(dtype)
    ids, weights, _ = blocks.softmax_topk(torch.randn(n, E, generator=g), K, True)
    table = torch.tensor([[w.data_ptr() for w in ws[e]] for e in range(E)])
    nd = native.NativeDecoder.__new__(native.NativeDecoder)  # only the library call is used
    nd.lib, nd.wbf16 = step_kernel.library(), dtype == torch.bfloat16
    nd.rnd = nd.wbf16
    lib_call = lambda: nd._moe_call(x, ids, weights, table, F)
    ref_call = lambda: blocks.dispatch_reference(
        x, ids, weights, lambda e, xs: blocks.silu_glu(xs, *ws[e])
    )[0]
    return lib_call, ref_call


def _seconds(fn, reps: int) -> float:
    fn()  # first use of each shape out of the timing
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(reps: int) -> list[dict]:
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for n in TOKENS:
            lib_call, ref_call = _setup(dtype, n)
            tol = 1e-4 if dtype == torch.float32 else 5e-2
            torch.testing.assert_close(lib_call(), ref_call(), atol=tol, rtol=tol)
            lib, ref = _seconds(lib_call, reps), _seconds(ref_call, reps)
            flop = n * K * 3 * F * D * 2
            row = {"dtype": str(dtype).removeprefix("torch."), "tokens": n,
                   "tokens_per_expert": n * K / E, "library_gflops": flop / lib / 1e9,
                   "torch_gflops": flop / ref / 1e9, "ratio": ref / lib}  # fmt: skip
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def report(rows: list[dict], reps: int, minutes: float) -> str:
    out = [
        "# Many-token expert call: the library vs the torch dispatch",
        "",
        (
            f"Command: `python -m experiments.bench_step_kernels --reps {reps}` "
            f"({minutes:.1f} min; code {code_version()}; one torch thread, one pool thread). "
            f"{E} random experts top-{K}, hidden {D}, expert width {F}; median of {reps} calls "
            "after one untimed call."
        ),
        "",
        "| dtype | tokens | tokens per expert | library GFLOP/s | torch GFLOP/s | speed-up |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(f"| {r['dtype']} | {r['tokens']} | {r['tokens_per_expert']:.0f} | "
                   f"{r['library_gflops']:.0f} | {r['torch_gflops']:.0f} | "
                   f"**{r['ratio']:.2f}** |")  # fmt: skip
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    if step_kernel.library() is None:
        raise SystemExit("the step kernels could not be built (no C compiler?)")
    torch.set_num_threads(1)
    t0 = time.time()
    rows = measure(args.reps)
    minutes = (time.time() - t0) / 60
    write_atomic(ROOT / "reports" / "step-kernels.md", report(rows, args.reps, minutes))
    res = {"code_version": code_version(), "reps": args.reps, "minutes": minutes, "rows": rows}
    write_atomic(ROOT / "reports" / "step-kernels.json", json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
