"""Fast MXFP4 decoding for the engine's expert path (reference: `reap.mxfp4.dequantize`).

Decoding an expert dominates a decode step on CPU (each weight is used for one or a few tokens),
so the engine decodes with a single table lookup per packed byte: the table is indexed by
(scale byte, packed byte) and holds both decoded values of the byte already multiplied by the
block scale, packed into one 4-byte (bf16 pair) or 8-byte (fp32 pair) word. Every table entry is
the same product `reap.mxfp4` computes (E2M1 value times 2^(e-127), exact in bf16 and fp32), so
the result is bit-identical to `reap.mxfp4.dequantize`; tests/test_engine.py checks that.

Two implementations of that lookup: a 12-line C loop compiled on first use with the system C
compiler (`cc -O3 -march=native`, cached under the reap cache directory, called through ctypes
with the GIL released, rows split over `threads` threads), and a pure-torch one (rows in chunks
of about a megabyte so the widened index stays in cache) used when no compiler is available or
`REAP_NO_CKERNEL=1`. Both index the same table, so they agree bit for bit.

    w = decode_mxfp4(packed, scales, torch.bfloat16)   # [O, N/2] + [O, N/32] uint8 -> [O, N]
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
import threading
from pathlib import Path

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


_C_SOURCE = r"""
#include <stdint.h>
#define DECODE(name, T)                                                                    \
void name(const uint8_t *p, const uint8_t *s, const T *table, T *out, int64_t blocks) {   \
    for (int64_t b = 0; b < blocks; b++) {                                                 \
        const T *t = table + ((int64_t)s[b] << 8);                                         \
        for (int k = 0; k < 16; k++) out[b * 16 + k] = t[p[b * 16 + k]];                  \
    }                                                                                      \
}
DECODE(reap_decode_u32, uint32_t)
DECODE(reap_decode_u64, uint64_t)
"""
_LIB: list = []  # [ctypes.CDLL or None] once tried
_LIB_LOCK = threading.Lock()


def _library():
    """The compiled C decoder, built once per source and machine; None if unavailable."""
    with _LIB_LOCK:
        if not _LIB:
            _LIB.append(None if os.environ.get("REAP_NO_CKERNEL") else _build())
        return _LIB[0]


def _build():
    from reap.defaults import cache_dir

    tag = hashlib.sha256((_C_SOURCE + os.uname().machine).encode()).hexdigest()[:16]
    so = cache_dir() / "kernels" / f"mxfp4-{tag}.so"
    try:
        if not so.is_file():
            so.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=so.parent) as tmp:
                src, out = Path(tmp) / "k.c", Path(tmp) / "k.so"
                src.write_text(_C_SOURCE)
                cmd = ["cc", "-O3", "-march=native", "-shared", "-fPIC", "-o", str(out), str(src)]
                subprocess.run(cmd, check=True, capture_output=True, timeout=120)
                os.replace(out, so)  # atomic: concurrent builds leave one complete file
        lib = ctypes.CDLL(str(so))
    except (OSError, subprocess.SubprocessError):
        return None  # no compiler or no write access: the torch path decodes
    for name in ("reap_decode_u32", "reap_decode_u64"):
        getattr(lib, name).restype = None
        getattr(lib, name).argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64]
    return lib


def decode_threads(n: int | None = None) -> int:
    """Threads the C decoder splits rows over (default: torch's intra-op thread count)."""
    return max(1, n if n is not None else torch.get_num_threads())


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
    lib = _library() if packed.device.type == "cpu" else None
    if lib is not None:
        _decode_c(lib, packed.contiguous(), scales.contiguous(), table, words)
    else:
        _decode_torch(packed, scales, table, words)
    return words.view(dtype).reshape(*lead, 2 * half)


def _decode_c(lib, packed, scales, table, words) -> None:
    """The C loop over all blocks into `words` [blocks * 16], block ranges split over threads."""
    fn = lib.reap_decode_u32 if table.dtype == torch.int32 else lib.reap_decode_u64
    blocks = scales.numel()
    n = min(decode_threads(), max(1, blocks // 4096))
    cuts = [blocks * i // n for i in range(n + 1)]
    size = table.element_size()

    def run(a: int, b: int) -> None:
        fn(
            packed.data_ptr() + 16 * a,
            scales.data_ptr() + a,
            table.data_ptr(),
            words.data_ptr() + 16 * a * size,
            b - a,
        )

    if n == 1:
        run(0, blocks)
    else:
        threads = [threading.Thread(target=run, args=(cuts[i], cuts[i + 1])) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


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
