"""Slow, obviously correct references of the library's fast paths that only tests use: the
MXFP4 and INT4 decoders written element by element from the bit-level definitions, the
fused MXFP4 kernel's arithmetic spelled out in torch, and RoPE computed per call."""

from __future__ import annotations

import torch

from reap.models.shared.attention import Rope
from reap.quant import int4, mxfp4


def _e2m1_value(code: int) -> float:
    """The E2M1 value of one 4-bit code, from its bit fields (1 sign, 2 exponent, 1 mantissa)."""
    sign = -1.0 if code & 8 else 1.0
    exponent, mantissa = (code >> 1) & 3, code & 1
    if exponent == 0:  # subnormal: 0 or 0.5
        return sign * 0.5 * mantissa
    return sign * 2.0 ** (exponent - 1) * (1.0 + 0.5 * mantissa)


def mxfp4_dequantize_reference(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Slow, obviously correct decode, one element at a time in plain Python: float64 [..., N]."""
    mxfp4._check_pair(packed, scales)
    p = packed.cpu().reshape(-1, packed.shape[-1]).tolist()
    s = scales.cpu().reshape(-1, scales.shape[-1]).tolist()
    rows = []
    for prow, srow in zip(p, s):
        row = []
        for j in range(2 * len(prow)):
            byte = prow[j // 2]
            code = byte & 15 if j % 2 == 0 else byte >> 4
            sbyte = srow[j // mxfp4.BLOCK]
            scale = float("nan") if sbyte == mxfp4.E8M0_NAN else 2.0 ** (sbyte - mxfp4.E8M0_BIAS)
            row.append(_e2m1_value(code) * scale)
        rows.append(row)
    out = torch.tensor(rows, dtype=torch.float64)
    return out.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def int4_dequantize_reference(
    packed: torch.Tensor, scales: torch.Tensor, group: int, cols: int | None = None
) -> torch.Tensor:
    """Slow, obviously correct decode in plain Python: float64 [O, I], the exact products
    q * scale (round to the scales' dtype to compare with `dequantize`)."""
    cols = int4._check(packed, scales, group, cols)
    words, s = packed.tolist(), scales.double().tolist()
    rows = []
    for wrow, srow in zip(words, s):
        row = []
        for i in range(cols):
            word = wrow[i // int4.PER_WORD] & 0xFFFFFFFF  # the word's 32 bits, unsigned
            code = (word >> (int4.BITS * (i % int4.PER_WORD))) & 0xF
            row.append((code - int4.OFFSET) * srow[i // group])
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float64).reshape(len(words), cols)


def mxfp4_linear_reference(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor):
    """The fused kernel's arithmetic in plain torch (slow; for tests): per row and token, lane j
    of two 16-lane fp32 accumulators adds w*x of column 2j (resp. 2j + 1) of each 32-column
    block, blocks in order; then the two are added and the lanes summed pairwise (halves 8, 4,
    2, 1). Equal to the kernel bit for bit when every product w*x is exact in fp32 (x with at
    most 21 significant bits, e.g. bf16 values): an fma then rounds exactly like the add."""
    w = mxfp4.dequantize(packed, scales, torch.float32)  # [O, I]
    rows, cols = w.shape
    xf = x.reshape(-1, cols).float()  # [M, I]
    prod = (xf[:, None, :] * w[None]).reshape(len(xf), rows, cols // 32, 16, 2)  # [M, O, nb, 16, 2]
    acc = torch.zeros(len(xf), rows, 16, 2)
    for b in range(cols // 32):
        acc = acc + prod[:, :, b]
    s = acc[..., 0] + acc[..., 1]  # [M, O, 16]
    for h in (8, 4, 2, 1):
        s = s[..., :h] + s[..., h : 2 * h]
    return s[..., 0].to(x.dtype).reshape(*x.shape[:-1], rows)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Unpack bytes uint8 [..., M] into 4-bit codes uint8 [..., 2*M] (low nibble first)."""
    mxfp4._check_uint8(packed, "packed")
    codes = torch.stack([packed & 15, packed >> 4], dim=-1)  # [..., M, 2]
    return codes.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def rope_reference(rope: Rope, x: torch.Tensor, start: int, interleaved: bool = False):
    """`rope.apply` with cos and sin computed for these positions only."""
    pos = torch.arange(start, start + x.shape[1], dtype=torch.float64)
    cos, sin = rope._cos_sin(pos)
    return rope._rotate(x, cos, sin, interleaved)
