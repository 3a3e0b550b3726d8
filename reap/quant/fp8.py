"""Block-scaled FP8 codec, as DeepSeek-V3 / Kimi K2 (and other FP8) releases store weights: a
weight [O, I] in F8_E4M3 next to `weight_scale_inv` [ceil(O/b0), ceil(I/b1)] float32, one scale
per (b0 x b1) block (128 x 128 in the releases; edge blocks are partial); value = fp8 * scale.

    q, scale_inv = quantize(w, (128, 128))        # w [O, I] -> F8_E4M3 [O, I], F32 [O/128, I/128]
    w_hat = dequantize(q, scale_inv, (128, 128))  # [O, I] float32
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0  # largest finite float8_e4m3fn


def _per_element(scale: torch.Tensor, block: tuple[int, int], shape) -> torch.Tensor:
    """Block scales [ceil(O/b0), ceil(I/b1)] -> one per element [O, I] float32."""
    O, I = shape
    rows = scale.float().repeat_interleave(block[0], 0)[:O]  # [O, ceil(I/b1)]
    return rows.repeat_interleave(block[1], 1)[:, :I]


def dequantize(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """w [O, I] (F8_E4M3, or any dtype holding its values) times its block's scale -> [O, I]
    float32."""
    return w.float() * _per_element(scale_inv, block, w.shape)


def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [O, I] -> (F8_E4M3 [O, I], scale_inv [ceil(O/b0), ceil(I/b1)] float32): each block is
    scaled so its largest magnitude maps to 448 (an all-zero block gets scale 1)."""
    (O, I), (b0, b1) = w.shape, block
    pad = torch.nn.functional.pad(w.float(), (0, (-I) % b1, 0, (-O) % b0))
    blocks = pad.reshape(pad.shape[0] // b0, b0, pad.shape[1] // b1, b1)  # [O/b0, b0, I/b1, b1]
    amax = blocks.abs().amax(dim=(1, 3))  # [O/b0, I/b1]
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    return (w.float() / _per_element(scale, block, w.shape)).to(torch.float8_e4m3fn), scale
