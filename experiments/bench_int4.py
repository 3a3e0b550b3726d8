"""INT4 (compressed-tensors pack-quantized) decode speed of one Kimi-K2-Thinking routed expert:
`reap.quant.int4.dequantize` (each byte split into its two nibbles) vs the bit-shift unpack (`int4.unpack` then the
multiply) vs compressed-tensors' own `unpack_from_int32` + `dequantize`, on the same tensors in
the same run, each checked equal to the others first.

The expert is the release's shape (hidden 7168, expert width 2048: gate and up [2048, 7168],
down [7168, 2048], groups of 32, BF16 scales), random words and scales. Times are the median
(and min) of --runs decodes of all three matrices, to bf16 (the release's dtype) and to fp32.

    python experiments/bench_int4.py --runs 5     # writes reports/int4.md and reports/int4.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from reap.provenance import code_version
from reap.quant import int4

D, F, GROUP = 7168, 2048, 32
SHAPES = {"gate_proj": (F, D), "up_proj": (F, D), "down_proj": (D, F)}


def expert(seed: int = 0) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """name -> (packed int32 [O, I/8], scales bf16 [O, I/32]) for the three matrices."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (O, I) in SHAPES.items():
        words = torch.randint(-(2**31), 2**31 - 1, (O, I // 8), dtype=torch.int32, generator=g)
        scales = (torch.rand(O, I // GROUP, generator=g) * 0.01 + 1e-4).bfloat16()
        out[name] = (words, scales)
    return out


def shift_path(words, scales, dtype):
    O, I = words.shape[0], words.shape[1] * 8
    q = int4.unpack(words, I).to(scales.dtype)  # [O, I]
    return (q.reshape(O, -1, GROUP) * scales.unsqueeze(-1)).reshape(O, I).to(dtype)


def ct_path(words, scales, dtype):
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                            group_size=GROUP)  # fmt: skip
    shape = torch.Size((words.shape[0], words.shape[1] * 8))
    return dequantize(unpack_from_int32(words, 4, shape), scales, None, args).to(dtype)


METHODS = {
    "reap int4.dequantize (byte nibbles)": lambda w, s, dt: int4.dequantize(w, s, GROUP, None, dt),
    "bit-shift unpack + multiply": shift_path,
    "compressed-tensors unpack_from_int32 + dequantize": ct_path,
}


def timed(fn, tensors, dtype, runs: int) -> tuple[float, float, float]:
    """(median wall, min wall, median CPU) seconds of decoding every matrix of the expert."""
    walls, cpus = [], []
    for _ in range(runs):
        w0, c0 = time.perf_counter(), time.process_time()
        for words, scales in tensors.values():
            fn(words, scales, dtype)
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    return statistics.median(walls), min(walls), statistics.median(cpus)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="reports")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    tensors = expert()
    for words, scales in tensors.values():  # the three paths agree bit for bit first
        want = ct_path(words, scales, torch.bfloat16)
        for fn in METHODS.values():
            assert torch.equal(fn(words, scales, torch.bfloat16), want)
    params = sum(O * I for O, I in SHAPES.values())
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for name, fn in METHODS.items():
            med, best, cpu = timed(fn, tensors, dtype, args.runs)
            rows.append({"method": name, "dtype": str(dtype).removeprefix("torch."),
                         "median_s": med, "min_s": best, "cpu_s": cpu,
                         "weights_per_s": params / med})  # fmt: skip
    write(Path(args.out), rows, params, args)


def write(out: Path, rows: list[dict], params: int, args) -> None:
    meta = {
        "expert_weights": params,
        "runs": args.runs,
        "threads": args.threads,
        "load_average": list(os.getloadavg()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "code_version": code_version(),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "int4.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = [
        "# INT4 decode speed (one Kimi-K2-Thinking routed expert)",
        "",
        (
            f"{params:,} weights (gate, up [2048, 7168], down [7168, 2048]; groups of 32, BF16 "
            f"scales); {args.runs} runs, {args.threads} thread(s). All methods decode to identical "
            "values (checked first)."
        ),
        "",
        "| method | to | median wall (s) | min wall (s) | median CPU (s) | M weights/s |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['method']} | {r['dtype']} | {r['median_s']:.3f} | {r['min_s']:.3f} "
                     f"| {r['cpu_s']:.3f} | {r['weights_per_s'] / 1e6:.0f} |")  # fmt: skip
    lines += [
        "",
        (
            f"- machine: {os.cpu_count()} CPUs shared with other jobs (load average "
            f"{[round(x, 2) for x in meta['load_average']]}), Python {meta['python']}, torch "
            f"{meta['torch']}. Under that load wall time overstates an idle machine's; all methods "
            "ran in the same process under the same conditions."
        ),
        (
            "- The engine decodes a routed expert's matrices this way on every use (no fused INT4 "
            "kernel yet; MXFP4 has one in `reap.quant.mxfp4_matmul`)."
        ),
        "",
        f"Reproduce: `python experiments/bench_int4.py --runs {args.runs}`",
        "",
    ]
    (out / "int4.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
