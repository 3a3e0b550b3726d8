"""Fast MXFP4 decoding for the engine's expert path (reference: `reap.mxfp4.dequantize`).

Decoding an expert dominates a decode step on CPU (each weight is used for one or a few tokens),
so the engine decodes with a single table lookup per packed byte: the table is indexed by
(scale byte, packed byte) and holds both decoded values of the byte already multiplied by the
block scale, packed into one 4-byte (bf16 pair) or 8-byte (fp32 pair) word. Every table entry is
the same product `reap.mxfp4` computes (E2M1 value times 2^(e-127), exact in bf16 and fp32), so
the result is bit-identical to `reap.mxfp4.dequantize`; tests/test_engine.py checks that. Rows
are decoded in chunks of about a megabyte so the widened index stays in cache.

    w = decode_mxfp4(packed, scales, torch.bfloat16)   # [O, N/2] + [O, N/32] uint8 -> [O, N]
"""

from __future__ import annotations

import torch

from reap import mxfp4

_TABLES: dict[torch.dtype, torch.Tensor] = {}
_CHUNK = 1 << 20  # packed bytes decoded per pass
_WORD = {torch.bfloat16: torch.int32, torch.float16: torch.int32, torch.float32: torch.int64}


def _table(dtype: torch.dtype) -> torch.Tensor:
    """[65536] words: entry (scale << 8 | byte) holds the byte's two values times the scale."""
    if dtype not in _TABLES:
        work = dtype if dtype in (torch.bfloat16, torch.float32) else torch.float32
        pairs = mxfp4._PAIR_LUT.to(work)  # [256, 2] low nibble first
        scales = mxfp4._SCALE_LUT.to(work)  # [256]
        values = (scales[:, None, None] * pairs[None]).to(dtype)  # [256 scales, 256 bytes, 2]
        _TABLES[dtype] = values.reshape(256 * 256, 2).contiguous().view(_WORD[dtype]).reshape(-1)
    return _TABLES[dtype]


def decode_mxfp4(
    packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """MXFP4 packed uint8 [..., N/2] with E8M0 scales uint8 [..., N/32] -> dtype [..., N]."""
    if dtype not in _WORD:
        return mxfp4.dequantize(packed, scales, dtype)
    lead, half = packed.shape[:-1], packed.shape[-1]
    nb = scales.shape[-1]
    if half != nb * (mxfp4.BLOCK // 2) or scales.shape[:-1] != lead:
        return mxfp4.dequantize(packed, scales, dtype)  # raises its shape error
    p = packed.reshape(-1, nb, mxfp4.BLOCK // 2)  # [R, nb, 16] bytes
    s = scales.reshape(-1, nb, 1)  # [R, nb, 1]
    table = _table(dtype).to(packed.device)
    words = torch.empty(p.shape[0] * half, dtype=table.dtype, device=packed.device)  # [R*N/2]
    # rows in chunks of ~1M bytes so the index buffer stays in cache (4-5x faster than one pass)
    step = max(1, _CHUNK // max(1, half))
    idx = torch.empty(
        (min(step, p.shape[0]), nb, mxfp4.BLOCK // 2), dtype=torch.int32, device=packed.device
    )
    for r in range(0, p.shape[0], step):
        n = min(step, p.shape[0] - r)
        i = idx[:n]
        i.copy_(p[r : r + n])  # widen the bytes
        i.bitwise_or_(s[r : r + n].to(torch.int32) << 8)  # [n, nb, 16] table index
        torch.index_select(table, 0, i.reshape(-1), out=words[r * half : (r + n) * half])
    return words.view(dtype).reshape(*lead, 2 * half)
