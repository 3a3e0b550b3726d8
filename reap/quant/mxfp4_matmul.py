"""MXFP4 matrix products for the engine's expert path: a fused kernel that multiplies straight
from the packed bytes (`mxfp4_linear`), and `MXFP4Kernels`, the engine's choice between it and
fast decode + dense matmul.

Why: at decode time an expert weight is used for one or a few tokens, so decoding it (writing 4x
its packed bytes as bf16, then reading them back) costs more than the arithmetic. The kernel
decodes each 32-column block into fp32 registers, times the block scale, and accumulates in a
fixed order. The engine uses it for bf16 compute on few rows; float32 keeps decode + dense
matmul, equal bit for bit to the in-memory forward.

    kernels = MXFP4Kernels(torch.bfloat16, pool, fused=fused_available(torch.bfloat16, "cpu"))
    weights = kernels.attach(fam.expert_matrices(tensors))   # MXFP4Matrix records use `kernels`
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from reap.quant import ckernel, mxfp4
from reap.quant.mxfp4_decode import BufferPool, decode_mxfp4

FUSED_MAX_ROWS = 8  # rows of x up to which the fused kernel beats decode + dense matmul


def mxfp4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor):
    """x [..., I] @ W.T for the MXFP4 matrix W [O, I] (packed uint8 [O, I/2], E8M0 scales
    [O, I/32]) without decoding W to memory: [..., O] in x's dtype, accumulated in fp32 (per
    block, lane j of two 16-lane sums takes columns 2j and 2j + 1; the sums added, the lanes
    summed pairwise), the same for a token alone or among others.
    None where the C kernel is unavailable (no compiler, REAP_NO_CKERNEL=1, not on CPU)."""
    lib = ckernel.library() if x.device.type == "cpu" else None
    if lib is None:
        return None
    rows, cols = packed.shape[0], 2 * packed.shape[1]
    xf = x.reshape(-1, cols).float()  # [M, I]
    m = xf.shape[0]
    if lib.reap_mxfp4_split_x():  # the vector kernel wants each block's even columns first
        xf = xf.reshape(m, cols // 32, 16, 2).transpose(-1, -2)  # [M, I/32, 2, 16]
    xf, packed, scales = xf.contiguous(), packed.contiguous(), scales.contiguous()
    y = torch.empty(m, rows)  # [M, O] fp32
    stab = mxfp4.SCALE_LUT

    def run(a: int, b: int) -> None:
        ptrs = (packed.data_ptr(), scales.data_ptr(), stab.data_ptr(), xf.data_ptr())
        lib.reap_mxfp4_linear(*ptrs, y.data_ptr(), a, b, rows, cols, m)

    ckernel.parallel(run, rows, 256, align=4)
    return y.to(x.dtype).reshape(*x.shape[:-1], rows)


def fused_available(dtype: torch.dtype, device: str) -> bool:
    """Whether experts run fused for this compute dtype: bf16/fp16 on a CPU with the C kernel
    (float32 keeps decode + dense matmul, equal bit for bit to the in-memory forward)."""
    half = dtype in (torch.bfloat16, torch.float16)
    return half and device == "cpu" and ckernel.library() is not None


@dataclass
class MXFP4Kernels:
    """How the engine multiplies by MXFP4 matrices computing in `dtype`: with `fused`, x of at
    most FUSED_MAX_ROWS rows in `dtype` goes through `mxfp4_linear`; otherwise the matrix is
    decoded by `decode_mxfp4` (into a buffer from `pool`, bit-identical to the reference decode)
    and multiplied densely."""

    dtype: torch.dtype
    pool: BufferPool | None = None
    fused: bool = False

    def linear(self, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """x [..., I] @ W.T -> [..., O] in x's dtype, for W [O, I] stored as (packed, scales)."""
        cols = 2 * packed.shape[1]
        few = x.dim() >= 1 and x.shape[-1] == cols and x.numel() <= FUSED_MAX_ROWS * cols
        if self.fused and few and x.dtype == self.dtype:
            y = mxfp4_linear(x, packed, scales)
            if y is not None:
                return y
        return x @ decode_mxfp4(packed, scales, self.dtype, self.pool).to(x.dtype).T

    def attach(self, weights: Mapping[str, object]) -> dict[str, object]:
        """`weights` with every MXFP4Matrix multiplied by these kernels instead of the reference."""
        out = dict(weights)
        for name, w in weights.items():
            if isinstance(w, mxfp4.MXFP4Matrix):
                out[name] = mxfp4.MXFP4Matrix(w.packed, w.scales, self)
        return out
