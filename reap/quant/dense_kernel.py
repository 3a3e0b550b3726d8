"""Compiled dense kernels for decode-shaped matmuls (`dense_kernels.c`): torch's bf16 CPU matmul
at one or a few rows runs far below the memory bandwidth, so few-row x @ W.T with W bf16 or fp32
runs here, accumulating in fp32.

The kernel and torch's matmul round differently, and which one runs depends on how many rows a
call has, so a token's numbers would depend on how it was batched. The engine fixes its own
batching, so it opts in (`with enabled()`); calibration must not (a sharded run has to equal one
process to float64 rounding), so outside `enabled()` torch does every matmul.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from functools import partial

import torch

from reap.quant import ckernel, step_kernel

MAX_ROWS = 8  # x rows (tokens) up to which the kernel beats torch's bf16 matmul
_LOCK = threading.Lock()
_ENABLED = [0]  # open `enabled()` blocks, process-wide (the engine's expert threads see it)


@contextmanager
def enabled():
    """Let `blocks.linear` use the kernel inside this block (the engine's forward step)."""
    with _LOCK:
        _ENABLED[0] += 1
    try:
        yield
    finally:
        with _LOCK:
            _ENABLED[0] -= 1


library = partial(ckernel.library, "dense")  # the compiled kernels; None if unavailable


def usable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Inside `enabled()`: bf16 or fp32 weights [out, in] (contiguous, on the CPU) times rows
    of the same dtype: a few (this library), or more (the step library's tiles: any number in
    fp32, up to `step_kernel.BF16_ROWS` in bf16)."""
    return _shapes_ok(x, w) and (_few_rows(x, w) or _many_rows(x, w))


def _few_rows(x: torch.Tensor, w: torch.Tensor) -> bool:
    return x.numel() // w.shape[1] <= MAX_ROWS and library() is not None


def _many_rows(x: torch.Tensor, w: torch.Tensor) -> bool:
    rows = x.numel() // w.shape[1]
    lib = step_kernel.library()
    return lib is not None and (w.dtype == torch.float32 or rows <= step_kernel.BF16_ROWS)


def _shapes_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    return (_ENABLED[0] > 0 and w.dtype in (torch.bfloat16, torch.float32) and x.dtype == w.dtype
            and w.dim() == 2 and x.device.type == w.device.type == "cpu" and w.is_contiguous()
            and w.shape[1] > 0 and x.shape[-1] == w.shape[1])  # fmt: skip


def dense_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ w[out, in].T (w bf16 or fp32, x any float dtype) in fp32 accumulation ->
    [..., out] in x's dtype (see `usable`); a few rows split over torch's intra-op threads for
    large `out`, more rows in the step library's tiles over its pool (the same arithmetic per
    output, so a row's result does not depend on how many came with it)."""
    rows, cols = w.shape
    xf = x.reshape(-1, cols).float().contiguous()  # [M, in]
    y = torch.empty(xf.shape[0], rows, dtype=torch.float32)  # [M, out]
    if xf.shape[0] > MAX_ROWS or library() is None:
        _tiles(xf, w, y)
        return y.to(x.dtype).reshape(*x.shape[:-1], rows)
    lib, ptrs = library(), (w.data_ptr(), xf.data_ptr(), y.data_ptr())
    fn = lib.reap_bf16_linear if w.dtype == torch.bfloat16 else lib.reap_f32_linear

    def run(a: int, b: int) -> None:
        fn(*ptrs, a, b, rows, cols, xf.shape[0])

    ckernel.parallel(run, rows, 2048)
    return y.to(x.dtype).reshape(*x.shape[:-1], rows)


def _tiles(xf: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> None:
    lib = step_kernel.library()
    with ckernel.spinning(lib):
        lib.reap_linear(xf.data_ptr(), w.data_ptr(), y.data_ptr(), xf.shape[0], *w.shape,
                        int(w.dtype == torch.bfloat16))  # fmt: skip


def swiglu_usable(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down) -> bool:
    """Whether `swiglu` takes this call: a few rows x [.., D] and dense gate/up [F, D], down
    [D, F] that `usable` accepts."""
    return (isinstance(down, torch.Tensor) and gate.shape == up.shape == down.shape[::-1]
            and _shapes_ok(x, gate) and _few_rows(x, gate) and up.dtype == down.dtype == gate.dtype
            and up.device.type == down.device.type == "cpu" and up.is_contiguous()
            and down.is_contiguous())  # fmt: skip


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor):
    """down(silu(gate(x)) * up(x)) of a few tokens x [.., D] (see `swiglu_usable`) in two
    compiled calls: gate, up, silu and product of each hidden row in one pass, then the down
    GEMV; intermediates rounded where torch's ops in x's dtype round them; a token's result
    does not depend on the others -> [.., D] in x's dtype."""
    F, D = gate.shape
    xf = x.reshape(-1, D).float().contiguous()  # [M, D]
    M = xf.shape[0]
    h = torch.empty(M, F, dtype=torch.float32)  # [M, F]
    y = torch.empty(M, D, dtype=torch.float32)  # [M, D]
    lib, bf16 = library(), x.dtype == torch.bfloat16
    gu = lib.reap_bf16_gate_up if bf16 else lib.reap_f32_gate_up
    lin = lib.reap_bf16_linear if bf16 else lib.reap_f32_linear
    pg, pu, px, ph, pd, py = (t.data_ptr() for t in (gate, up, xf, h, down, y))
    ckernel.parallel(lambda a, b: gu(pg, pu, px, ph, a, b, F, D, M, bf16), F, 1024)
    ckernel.parallel(lambda a, b: lin(pd, ph, py, a, b, D, F, M), D, 2048)
    return y.to(x.dtype).reshape(x.shape)
