"""The compiled decode step (`ckernel.library("step")`; sources beside this file: `step_kernels.c`,
the many-token experts in `prefill_kernels.c`, the pool in `step_pool.c`, shared arithmetic in
`step_common.h`, argument blocks in `step_args.h`): one token through a pre-norm layer (RMSNorm,
grouped-query RoPE attention over a KV cache, softmax top-k router, SwiGLU experts) in two
calls, and the final norm and head in a third (or a whole token, every layer and the head, in
one call), every matrix-vector product split by rows over the kernels' pool
(`ckernel.pooled`). `REAP_NO_CKERNEL=1` or `REAP_NO_NATIVE=1` turns it off (the torch path
then runs every step).

    lib = library()                       # None when unavailable
    lib.reap_attn_step(args, floats)      # args: int64[len(ATTN)], floats: eps, scale
    lib.reap_moe_step(args)               # args: int64[len(MOE)]
    lib.reap_head_step(h, norm, head, V, D, wbf16, rnd, eps, x, logits)
    lib.reap_token_step(args, floats)     # args: int64[len(TOKEN)]: every layer and the head
    lib.reap_moe_prefill(pack(PREFILL, x=..., ...))  # the routed experts of N tokens
    lib.reap_attn_prefill(args, floats, n)  # the attention half of n tokens (ATTN indices)
    lib.reap_attn_prefill_scratch(args, n)  # the floats of scratch it needs
    lib.reap_residual(h, y, n, rnd)       # h = rb(h + rb(y)) over n floats
    lib.reap_linear(x, w, y, n, rows, cols, wbf16)  # y = x @ w.T over the pool, fp32 x, y
    lib.reap_linear_pairs(x, w, y, n, rows, cols)  # bf16 x, w in the pair order (0: no such)

Arithmetic and rounding are documented in the C source: every dot product is the compiled
GEMV's (`dense_kernels.c`), results never depend on the thread count.
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
    if os.environ.get("REAP_NO_NATIVE"):
        return None
    return ckernel.library("step", flags, where)


def pack(table: dict[str, int], **values: int) -> ctypes.Array:
    """The int64 argument block of `table`'s layout with every field given by name."""
    if values.keys() != table.keys():
        raise TypeError(f"argument block fields {sorted(values)} are not {sorted(table)}")
    block = (ctypes.c_int64 * len(table))()
    for name, v in values.items():
        block[table[name]] = v
    return block
