"""MXFP4 codec (OCP Microscaling v1.0): pack, unpack, quantize and dequantize in torch.

Layout, as stored in checkpoints: blocks of 32 values along the last axis. Each value is an FP4
E2M1 code (bit 3 sign, bits 0-2 magnitude index into {0, 0.5, 1, 1.5, 2, 3, 4, 6}); two codes per
byte, the LOW nibble holding the EVEN column. Each block shares one E8M0 scale byte:
scale = 2 ** (byte - 127), byte 255 = NaN.

    packed, scales = quantize(w)          # w [..., N] -> [..., N//2], [..., N//32] uint8
    w_hat = dequantize(packed, scales)    # [..., N] float32 (or dtype=)
    y = fake_quant(w)                     # quantize-dequantize with a straight-through gradient

A stored matrix handed to model code is an `MXFP4Matrix`; faster paths: `mxfp4_decode`,
`mxfp4_matmul`.

Quantization follows the OCP spec: shared exponent floor(log2(amax)) - 2 (clamped to the E8M0
range [-127, 127]), elements rounded to nearest with ties to even onto the E2M1 grid, saturating
at +-6. An all-zero block gets scale byte 127 (scale 1.0); a block holding Inf or NaN gets byte 255.
Negative values that round to zero are stored as +0 (code 0), so -0 never appears.

mlx (`mx.quantize(..., mode="mxfp4")`) uses the same byte layout but a different rounding rule:
its scale is the smallest power of two with amax / scale <= 6 (it never saturates), and element
ties round toward zero. The two produce identical bytes when every block's amax has a mantissa
(amax / 2**floor(log2(amax))) of at most 1.5 and no scaled element lies exactly on a midpoint;
dequantizing identical bytes agrees exactly (see tests/test_mxfp4.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.nn.functional import embedding

from reap.errors import ReapError
from reap.quant.matrix import MAX_WEIGHT

if TYPE_CHECKING:
    from reap.quant.mxfp4_matmul import MXFP4Kernels

BLOCK = 32
E8M0_BIAS = 127
E8M0_NAN = 255

FP4_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)

# Rounding thresholds between magnitude codes i and i+1 (midpoints of the E2M1 grid). Round to
# nearest, ties to even: a tie between codes i and i+1 goes to the even one, so the comparison
# is strict (>) when i is even and inclusive (>=) when i is odd.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)

# byte -> the two decoded values (low nibble first)  [256, 2]
PAIR_LUT = torch.stack([FP4_VALUES[torch.arange(256) & 15], FP4_VALUES[torch.arange(256) >> 4]], 1)
# byte -> 2 ** (byte - 127), NaN at 255; 2**-127 is an exact float32 subnormal  [256]
SCALE_LUT = torch.tensor(
    [2.0 ** (i - E8M0_BIAS) for i in range(255)] + [float("nan")], dtype=torch.float32
)


def _check_uint8(t: torch.Tensor, what: str) -> None:
    if t.dtype != torch.uint8:
        raise ReapError(f"mxfp4: {what} must be uint8, got {t.dtype}")


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes uint8 [..., N] (N even, values < 16) into bytes uint8 [..., N//2];
    the low nibble holds the even column."""
    _check_uint8(codes, "codes")
    if codes.shape[-1] % 2:
        raise ReapError(f"mxfp4: cannot pack an odd number of codes ({codes.shape[-1]})")
    if codes.numel() and int(codes.max()) > 15:
        raise ReapError("mxfp4: codes must be below 16")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _check_pair(packed: torch.Tensor, scales: torch.Tensor) -> None:
    _check_uint8(packed, "packed")
    _check_uint8(scales, "scales")
    if packed.shape[:-1] != scales.shape[:-1] or packed.shape[-1] * 2 != scales.shape[-1] * BLOCK:
        raise ReapError(
            f"mxfp4: packed {tuple(packed.shape)} does not match scales "
            f"{tuple(scales.shape)} (expected [..., N//2] and [..., N//32])"
        )


def dequantize(
    packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Decode MXFP4: packed uint8 [..., N//2] and scales uint8 [..., N//32] -> dtype [..., N].

    Exact: every decoded value is representable in bf16 and float32 (float16 may overflow)."""
    _check_pair(packed, scales)
    # bf16/f32/f64 hold every product exactly, so compute in place; others go through float32
    work = dtype if dtype in (torch.bfloat16, torch.float32, torch.float64) else torch.float32
    pair_lut = PAIR_LUT.to(device=packed.device, dtype=work)
    scale_lut = SCALE_LUT.to(device=packed.device, dtype=work)
    n_blocks = scales.shape[-1]
    # embedding() is torch's fastest row gather on CPU (1.5x plain indexing here)
    values = embedding(packed.long(), pair_lut)  # [..., N//2, 2]
    values = values.reshape(*packed.shape[:-1], n_blocks, BLOCK)  # [..., B, 32]
    values = values * embedding(scales.long(), scale_lut.unsqueeze(1))  # [..., B, 32]
    return values.reshape(*packed.shape[:-1], n_blocks * BLOCK).to(dtype)


def _shared_exponent(amax: torch.Tensor) -> torch.Tensor:
    """OCP shared exponent floor(log2(amax)) - 2 per block, clamped to [-127, 127]; 0 for zero
    blocks. int32 [..., B]."""
    _, exp = torch.frexp(amax)  # amax = m * 2**exp with m in [0.5, 1): floor(log2) = exp - 1
    shared = (exp.to(torch.int32) - 1 - 2).clamp(-E8M0_BIAS, E8M0_BIAS)
    return torch.where(amax > 0, shared, torch.zeros_like(shared))


def _round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round scaled values onto E2M1 codes (nearest, ties to even, saturate at 6): uint8, same
    shape."""
    mag = x.abs()
    codes = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for i, mid in enumerate(_MIDPOINTS):
        codes += (mag >= mid) if i % 2 else (mag > mid)
    negative = (x < 0) & (codes > 0)
    return codes | (negative.to(torch.uint8) << 3)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize w [..., N] (N a multiple of 32; bf16/f16/f32) to MXFP4.

    Returns (packed uint8 [..., N//2], scales uint8 [..., N//32])."""
    n = w.shape[-1] if w.dim() else 0
    if w.dim() == 0 or n % BLOCK:
        raise ReapError(
            f"mxfp4: last dimension must be a multiple of {BLOCK}, got shape {tuple(w.shape)}"
        )
    lead = w.shape[:-1]
    x = w.detach().to(torch.float32).reshape(*lead, n // BLOCK, BLOCK)  # [..., B, 32]
    amax = x.abs().amax(dim=-1)  # [..., B]
    finite = torch.isfinite(amax)
    shared = _shared_exponent(torch.where(finite, amax, torch.zeros_like(amax)))
    # power-of-two scaling is exact here: |x| / 2**shared < 8 and 2**-shared fits in float32
    scaled = x * torch.exp2(-shared.to(torch.float32)).unsqueeze(-1)  # [..., B, 32]
    codes = _round_e2m1(scaled)
    codes = torch.where(finite.unsqueeze(-1), codes, torch.zeros_like(codes))
    scales = torch.where(
        finite,
        (shared + E8M0_BIAS).to(torch.uint8),
        torch.full_like(shared, E8M0_NAN, dtype=torch.uint8),
    )
    packed = pack_nibbles(codes.reshape(*lead, n))
    return packed, scales


def qdq(w: torch.Tensor) -> torch.Tensor:
    """Quantize-dequantize (fake quant) w [..., N]: same shape and dtype; no gradient."""
    packed, scales = quantize(w)
    return dequantize(packed, scales, dtype=w.dtype)


def fake_quant(w: torch.Tensor) -> torch.Tensor:
    """MXFP4 fake quantization with a straight-through estimator: the forward value is qdq(w),
    the gradient with respect to w is the identity. Same shape and dtype as w."""
    return w + (qdq(w) - w).detach()


@dataclass(frozen=True, eq=False)
class MXFP4Matrix:
    """A weight matrix W [O, I] stored in MXFP4: packed uint8 [O, I/2], E8M0 scales uint8
    [O, I/32]. A typed record, not a tensor: `reap.models.shared.blocks.linear` applies it through
    `linear(x)`, which uses `kernels` when set (the engine's `reap.quant.mxfp4_matmul.MXFP4Kernels`:
    fused kernel or fast decode) and else the reference, `dequantize` in x's dtype."""

    packed: torch.Tensor
    scales: torch.Tensor
    kernels: MXFP4Kernels | None = None

    @property
    def shape(self) -> torch.Size:
        """[O, I], the decoded shape."""
        return torch.Size((self.packed.shape[0], 2 * self.packed.shape[1]))

    def dense(self, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
        """The decoded matrix [O, I] in `dtype` (on `device`, default where the bytes are)."""
        device = device or self.packed.device
        return dequantize(self.packed.to(device), self.scales.to(device), dtype)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., I] @ W.T -> [..., O] in x's dtype."""
        if self.kernels is not None:
            return self.kernels.linear(x, self.packed, self.scales)
        return x @ self.dense(x.dtype, x.device).T

    def check(self, what: str) -> None:
        """Raise ReapError if a scale byte is 255 (NaN) or decodes weights beyond `MAX_WEIGHT`:
        no trained matrix has one, so the bytes are corrupt (`what` names the matrix)."""
        top = int(self.scales.max()) if self.scales.numel() else 0
        if not float(SCALE_LUT[top]) * 6 <= MAX_WEIGHT:  # 6: the largest E2M1 magnitude
            raise ReapError(f"{what}: E8M0 scale byte {top}: NaN or weights beyond 2^16: corrupt")
