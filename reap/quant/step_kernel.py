"""The compiled decode step (`ckernel.library("step")`; sources `step_kernels.c`,
`prefill_kernels.c`, `step_pool.c` and their headers): one token through a pre-norm layer
(RMSNorm, grouped-query RoPE attention over a KV cache, softmax top-k router, SwiGLU experts) in
two calls and the head in a third, or a whole token in one; products split by rows over the pool,
results never depending on the thread count (arithmetic documented in the C source).

    lib = library()                                   # None when unavailable
    lib.reap_attn_step(put(block, ATTN, h=..., ...), floats)  # int64 blocks filled by name
    lib.reap_moe_prefill(pack(PREFILL, x=..., ...))   # a new block, every field given
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from reap.quant import ckernel

# name -> index of the int64 argument blocks (`step_args.h`)
ATTN, MOE, TOKEN, PREFILL = ({n: i for i, n in enumerate(ckernel.ARGS[b])}
                             for b in ("attn", "moe", "token", "prefill"))  # fmt: skip


def bf16_dot() -> bool:
    """Whether the CPU has bf16 dot-product instructions (AVX512_BF16, AMX), which torch's bf16
    matmul runs on."""
    return bool({"avx512_bf16", "amx_bf16"} & set(ckernel.machine_tag().split()))


# bf16 weights times many rows: the library's tiles (bf16 widened, fp32 FMAs) beat torch's bf16
# matmul on the CPU's bf16 dot-product instructions up to about this many rows per weight
# matrix, torch above it (experiments/bench_step_kernels.py, reports/step-kernels.md). Without
# those instructions torch's bf16 matmul took 3.4-5.6x the tiles' time at every size measured
# (17-512 rows, 1 and 2 threads, AVX2 Zen 3): the tiles take every size. In fp32 the tiles are
# ahead at every size on both.
BF16_ROWS = 16 if bf16_dot() else 1 << 40
# Many-token steps in bf16 on CPUs with bf16 dot products: the compiled layers (attention
# products and routed experts in the pair order, prefill_bf16dot.h) take steps of up to this
# many tokens and experts with up to this many tokens on average; torch above it. Measured on
# Zen 4 (reports/llamacpp-avx512.md, 2 threads): 32-token prefill 1.06-1.08x torch's path,
# 512 tokens 0.83-0.92x through the compiled layers. Without those instructions: every size.
PAIR_ROWS = 32 if bf16_dot() else 1 << 40
MAX_TOP_K = 256  # routed experts per token the kernels hold on the stack (route, MAX_K, done)


def library(flags: tuple[str, ...] = (), where: Path | None = None):
    """The compiled step kernels (`ckernel.library`: other compiler `flags`, sources in
    `where`); None if unavailable or turned off."""
    return None if os.environ.get("REAP_NO_NATIVE") else ckernel.library("step", flags, where)


def put(block, layout: dict[str, int], /, **values: int):
    """Set fields of an int64 argument block by name (`layout`: ATTN, MOE, TOKEN or PREFILL)."""
    for name, v in values.items():
        block[layout[name]] = v
    return block


def pack(layout: dict[str, int], /, **values: int) -> ctypes.Array:
    """A new int64 argument block of `layout`, every field given by name."""
    if values.keys() != layout.keys():
        raise TypeError(f"argument block fields {sorted(values)} are not {sorted(layout)}")
    return put((ctypes.c_int64 * len(layout))(), layout, **values)
