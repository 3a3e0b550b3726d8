"""Fast MXFP4 decoding, bit-identical to its reference `reap.quant.mxfp4.dequantize`.

One table lookup per packed byte: the table is indexed by (scale byte, packed byte) and holds both
decoded values of the byte already multiplied by the block scale (exact in bf16 and fp32), packed
into one 4-byte (bf16 pair) or 8-byte (fp32 pair) word. The lookup runs in C (`ckernel`) or in
torch (rows in chunks of about a megabyte so the widened index stays in cache) when no compiler
is available or `REAP_NO_CKERNEL=1`.

    w = decode_mxfp4(packed, scales, torch.bfloat16, pool)   # [O, N/2] + [O, N/32] -> [O, N]
"""

from __future__ import annotations

import torch

from reap.quant import ckernel, mxfp4

_TABLES: dict[torch.dtype, torch.Tensor] = {}
_CHUNK = 1 << 20  # packed bytes decoded per pass
_WORD = {torch.bfloat16: torch.int32, torch.float16: torch.int32, torch.float32: torch.int64}


def _table(dtype: torch.dtype) -> torch.Tensor:
    """[65536] words: entry (scale << 8 | byte) holds the byte's two values times the scale."""
    if dtype not in _TABLES:
        work = dtype if dtype in (torch.bfloat16, torch.float32) else torch.float32
        pairs = mxfp4.PAIR_LUT.to(work)  # [256, 2] low nibble first
        scales = mxfp4.SCALE_LUT.to(work)  # [256]
        values = (scales[:, None, None] * pairs[None]).to(dtype)  # [256 scales, 256 bytes, 2]
        _TABLES[dtype] = values.reshape(256 * 256, 2).contiguous().view(_WORD[dtype]).reshape(-1)
    return _TABLES[dtype]


class BufferPool:
    """Output buffers reused across decodes (fresh 20-40 MB allocations cost more in page
    faults than the decode itself). A buffer is handed out again only when no tensor refers to
    its storage any more, so a caller that keeps a decoded weight never sees it overwritten.
    Holds at most `max_bytes`; beyond that, buffers are plain allocations."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.buffers = max_bytes, []

    def take(self, nbytes: int, device) -> torch.Tensor:
        """A uint8 buffer of at least `nbytes` on `device` that nothing else uses."""
        for buf in self.buffers:
            if buf.numel() >= nbytes and buf.device == device and _unused(buf):
                return buf
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        if _USES is not None and sum(b.numel() for b in self.buffers) + nbytes <= self.max_bytes:
            self.buffers.append(buf)
        return buf


def _storage_uses(t: torch.Tensor) -> int | None:
    try:
        return torch._C._storage_Use_Count(t.untyped_storage()._cdata)
    except (AttributeError, RuntimeError):  # private API gone: never reuse
        return None


_USES = _storage_uses(torch.empty(1))  # the count of a storage held by one tensor


def _unused(buf: torch.Tensor) -> bool:
    return _USES is not None and _storage_uses(buf) == _USES


def decode_mxfp4(
    packed: torch.Tensor,
    scales: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    pool: BufferPool | None = None,
) -> torch.Tensor:
    """MXFP4 packed uint8 [..., N/2] with E8M0 scales uint8 [..., N/32] -> dtype [..., N]
    (written into a buffer from `pool` when given)."""
    if dtype not in _WORD:
        return mxfp4.dequantize(packed, scales, dtype)
    lead, half = packed.shape[:-1], packed.shape[-1]
    nb = scales.shape[-1]
    if half != nb * (mxfp4.BLOCK // 2) or scales.shape[:-1] != lead:
        return mxfp4.dequantize(packed, scales, dtype)  # raises its shape error
    table = _table(dtype).to(packed.device)
    n = packed.numel() * table.element_size()
    buf = pool.take(n, packed.device) if pool is not None else None
    words = (
        buf[:n] if buf is not None else torch.empty(n, dtype=torch.uint8, device=packed.device)
    ).view(table.dtype)  # [R * N/2] value pairs
    lib = ckernel.library() if packed.device.type == "cpu" else None
    if lib is not None:
        _decode_c(lib, packed.contiguous(), scales.contiguous(), table, words)
    else:
        _decode_torch(packed, scales, table, words)
    return words.view(dtype).reshape(*lead, 2 * half)


def _decode_c(lib, packed, scales, table, words) -> None:
    """The C loop over all blocks into `words` [blocks * 16], block ranges split over threads."""
    fn = lib.reap_decode_u32 if table.dtype == torch.int32 else lib.reap_decode_u64
    size = table.element_size()

    def run(a: int, b: int) -> None:
        ptrs = (packed.data_ptr() + 16 * a, scales.data_ptr() + a, table.data_ptr())
        fn(*ptrs, words.data_ptr() + 16 * a * size, b - a)

    ckernel.parallel(run, scales.numel(), 4096)


def _decode_torch(packed, scales, table, words=None) -> torch.Tensor:
    """The same lookup with torch ops into `words` [R * N/2], rows in cache-sized chunks."""
    nb, half = scales.shape[-1], packed.shape[-1]
    p = packed.reshape(-1, nb, mxfp4.BLOCK // 2)  # [R, nb, 16] bytes
    s = scales.reshape(-1, nb, 1)  # [R, nb, 1]
    if words is None:
        words = torch.empty(p.shape[0] * half, dtype=table.dtype, device=packed.device)
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
    return words
