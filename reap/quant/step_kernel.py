"""The compiled decode step (sources beside this file: `step_kernels.c`, the many-token experts
in `prefill_kernels.c`, the pool in `step_pool.c`, shared arithmetic in `step_common.h`): one
token through a pre-norm layer (RMSNorm, grouped-query RoPE attention over a KV cache, softmax
top-k router, SwiGLU experts) in two calls, and the final norm and head in a third (or a
whole token, every layer and the head, in one call), with a persistent thread pool inside the
library that splits every matrix-vector product by rows. Built on first use like the other
kernels (`reap.quant.ckernel.compile_cached`); `REAP_NO_CKERNEL=1` or
`REAP_NO_NATIVE=1` turns it off (the torch path then runs every step).

    lib = library()                       # None when unavailable
    lib.reap_pool_size(2)                 # threads (the caller included)
    lib.reap_pool_spin(SPINS)             # idle workers spin this long, then sleep (0: at once)
    lib.reap_attn_step(args, floats)      # int64[ATTN_ARGS] (indices ATTN), floats: eps, scale
    lib.reap_moe_step(args)               # args: int64[MOE_ARGS] (indices MOE)
    lib.reap_head_step(h, norm, head, V, D, wbf16, rnd, eps, x, logits)
    lib.reap_token_step(args, floats)     # args: int64[TOKEN_ARGS]: every layer and the head
    lib.reap_moe_prefill(args)            # args: int64[15]: the routed experts of N tokens
    lib.reap_attn_prefill(args, floats, n)  # the attention half of n tokens (ATTN indices)
    lib.reap_attn_prefill_scratch(args, n)  # the floats of scratch it needs
    lib.reap_residual(h, y, n, rnd)       # h = rb(h + rb(y)) over n floats
    lib.reap_linear(x, w, y, n, rows, cols, wbf16)  # y = x @ w.T over the pool, fp32 x, y
    lib.reap_linear_pairs(x, w, y, n, rows, cols)  # bf16 x, w in the pair order (0: no such)
    pooled(lib, lib.reap_linear, *args)  # a many-token call between torch ops
    with spinning(lib): ...               # many calls, little torch between (a prefill step)

Arithmetic and rounding are documented in the C source: every dot product is the compiled
GEMV's (`dense_kernels.c`), results never depend on the thread count.
"""

from __future__ import annotations

import ctypes
import os
import threading
from contextlib import contextmanager
from pathlib import Path

from reap.quant import ckernel

_HERE = Path(__file__).parent
_SOURCES = [_HERE / n for n in ("step_pool.c", "step_kernels.c", "prefill_kernels.c")]
# argument names in index order, as the enums of step_kernels.c
ATTN_ARGS = (
    "h", "x2", "scratch", "in_norm", "wq", "wk", "wv", "wo", "q_norm", "k_norm", "post_norm",
    "router", "cos", "sin", "kc", "vc", "cap", "pos", "d", "heads", "kv_heads", "dh", "rot", "qk",
    "window", "e", "k", "renorm", "wbf16", "rnd", "ids", "weights",
)  # fmt: skip
TOKEN_ARGS = ("layers", "attn", "tables", "dense", "f", "moe", "times", "norm", "head", "v", "x",
              "logits", "pos", "emb", "emb_bf16")  # fmt: skip
MOE_ARGS = ("x2", "h", "scratch", "k", "f", "d", "wbf16", "rnd", "weights", "gate", "up", "down")
ATTN = {n: i for i, n in enumerate(ATTN_ARGS)}  # name -> index
MOE = {n: i for i, n in enumerate(MOE_ARGS)}
TOKEN = {n: i for i, n in enumerate(TOKEN_ARGS)}


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
SPINS = 20000  # pause loops idle workers spin between decode calls (0 after a prefill call)
_LIB: list = []
_LOCK = threading.Lock()
_SPINNING = [0]  # open `spinning()` blocks


def library():
    """The compiled step kernels, built once per source and machine; None if unavailable."""
    if _LIB:
        return _LIB[0]
    with _LOCK:
        if not _LIB:
            off = os.environ.get("REAP_NO_CKERNEL") or os.environ.get("REAP_NO_NATIVE")
            _LIB.append(None if off else build())
        return _LIB[0]


def pooled(lib, fn, *args) -> None:
    """fn(*args), a library call that splits its work over the pool (a prefill call, between
    torch ops): the pool at the kernels' thread count (`ckernel.threads`), its workers spinning
    while it runs and, outside `spinning()`, sleeping at once after it, so that torch's OpenMP
    threads get the cores next."""
    lib.reap_pool_size(ckernel.threads())
    lib.reap_pool_spin(SPINS)
    fn(*args)
    if not _SPINNING[0]:
        lib.reap_pool_spin(0)


@contextmanager
def spinning(lib):
    """A step of many library calls with little torch work between them (on one thread): the
    pool's workers keep spinning between the calls inside, and sleep at once after the
    outermost block."""
    lib.reap_pool_size(ckernel.threads())
    lib.reap_pool_spin(SPINS)
    _SPINNING[0] += 1
    try:
        yield
    finally:
        _SPINNING[0] -= 1
        if not _SPINNING[0]:
            lib.reap_pool_spin(0)


def build(flags: tuple[str, ...] = (), where: Path = _HERE):
    """The step kernels compiled with extra compiler `flags` (for the tests: "-mno-avx512f"
    runs AVX2 where the CPU has it, "-mno-avx2" the plain C loops) from the sources in `where`
    (a benchmark's copy of another version), signatures declared; None when they cannot be
    built."""
    sources = [where / p.name for p in _SOURCES]
    lib = ckernel.compile_cached(sources, "step", ("-pthread", *flags))
    if lib is None:
        return None
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.reap_simd.restype = ctypes.c_int
    lib.reap_simd.argtypes = []
    lib.reap_pool_size.restype = ctypes.c_int
    lib.reap_pool_size.argtypes = [ctypes.c_int]
    lib.reap_pool_spin.restype = None
    lib.reap_pool_spin.argtypes = [ctypes.c_int]
    lib.reap_attn_step.restype = None
    lib.reap_attn_step.argtypes = [ptr, ptr]
    lib.reap_moe_step.restype = None
    lib.reap_moe_step.argtypes = [ptr]
    lib.reap_token_step.restype = None
    lib.reap_token_step.argtypes = [ptr, ptr]
    lib.reap_linear.restype = None
    lib.reap_linear.argtypes = [ptr] * 3 + [i64] * 4
    lib.reap_attn_prefill.restype = None
    lib.reap_attn_prefill.argtypes = [ptr, ptr, i64]
    lib.reap_attn_prefill_scratch.restype = i64
    lib.reap_attn_prefill_scratch.argtypes = [ptr, i64]
    lib.reap_residual.restype = None
    lib.reap_residual.argtypes = [ptr, ptr, i64, i64]
    lib.reap_moe_prefill.restype = None
    lib.reap_moe_prefill.argtypes = [ptr]
    lib.reap_linear_pairs.restype = ctypes.c_int
    lib.reap_linear_pairs.argtypes = [ptr] * 3 + [i64] * 3
    lib.reap_moe_prefill_scratch.restype = None
    lib.reap_moe_prefill_scratch.argtypes = [i64] * 5 + [ptr]
    lib.reap_head_step.restype = None
    lib.reap_head_step.argtypes = [ptr] * 3 + [i64] * 4 + [ctypes.c_double, ptr, ptr]
    return lib
