"""MXFP4 kernels for the engine's expert path: fast decoding (reference: `reap.mxfp4.dequantize`)
and a fused matmul that never decodes (reference: `mxfp4_linear_reference`).

Decoding uses a single table lookup per packed byte: the table is indexed by (scale byte, packed
byte) and holds both decoded values of the byte already multiplied by the block scale, packed
into one 4-byte (bf16 pair) or 8-byte (fp32 pair) word. Every table entry is the same product
`reap.mxfp4` computes (E2M1 value times 2^(e-127), exact in bf16 and fp32), so the result is
bit-identical to `reap.mxfp4.dequantize`; tests/test_engine.py checks that. Two implementations
of that lookup: a C loop and a pure-torch one (rows in chunks of about a megabyte so the widened
index stays in cache) used when no compiler is available or `REAP_NO_CKERNEL=1`.

At decode time an expert weight is used for one or a few tokens, so decoding it (writing 4x its
packed bytes as bf16, then reading them back for the matmul) costs more than the arithmetic.
`mxfp4_linear` multiplies straight from the packed bytes: per 32-column block, 16 bytes become
32 fp32 weights in registers (AVX-512 permute of a 16-entry table; a plain-C loop elsewhere,
same arithmetic), times the block scale, fused-multiply-added into fp32 accumulators in a fixed
order. The engine uses it for bf16 compute (`MXFP4Weight`, `expert_weights`); float32 keeps
decode + dense matmul, equal bit for bit to the in-memory forward.

The C source is compiled on first use with the system C compiler (`cc -O3 -march=native`,
cached under the reap cache directory, called through ctypes with the GIL released, rows split
over torch's intra-op thread count).

    w = decode_mxfp4(packed, scales, torch.bfloat16)   # [O, N/2] + [O, N/32] uint8 -> [O, N]
    y = mxfp4_linear(x, packed, scales)                # x [M, N] -> [M, O], None without cc
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
from reap.errors import WriteError
from reap.fileio import atomic_path

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
#include <string.h>
#include <math.h>
#define DECODE(name, T)                                                                    \
void name(const uint8_t *p, const uint8_t *s, const T *table, T *out, int64_t blocks) {   \
    for (int64_t b = 0; b < blocks; b++) {                                                 \
        const T *t = table + ((int64_t)s[b] << 8);                                         \
        for (int k = 0; k < 16; k++) out[b * 16 + k] = t[p[b * 16 + k]];                  \
    }                                                                                      \
}
DECODE(reap_decode_u32, uint32_t)
DECODE(reap_decode_u64, uint64_t)

/* y[t, o] = x[t] . W[o] with W in MXFP4, without decoding W to memory. Per (row, token): two
   16-lane fp32 accumulators, lane j of the first takes column 2j of every 32-column block (the
   low nibble of byte j), lane j of the second column 2j + 1, blocks in order (fmaf); then the
   two are added and the 16 lanes summed pairwise. Nothing depends on the token count or the
   row range, so a token's result is the same alone or in a batch. */
static const float FP4[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f,
                              -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};
static float reduce(const float *a, const float *c) {
    float s[16];
    for (int j = 0; j < 16; j++) s[j] = a[j] + c[j];
    for (int w = 8; w > 0; w >>= 1)
        for (int j = 0; j < w; j++) s[j] += s[j + w];
    return s[0];
}
#if defined(__AVX512F__)
#include <immintrin.h>
#define SPLIT_X 1 /* x arrives with each block's even columns first, then its odd ones */
static inline __attribute__((always_inline)) void tile(
    const uint8_t *p, const uint8_t *s, const float *stab, const float *x, int64_t cols,
    float *y, int64_t ldy, const int RN, const int TN) {
    const __m512 lut = _mm512_loadu_ps(FP4);
    const __m512i low = _mm512_set1_epi32(15);
    __m512 a[4][4][2];
    int64_t nb = cols / 32;
    for (int r = 0; r < RN; r++)
        for (int t = 0; t < TN; t++) a[r][t][0] = a[r][t][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++)
        for (int r = 0; r < RN; r++) {
            __m512i d = _mm512_cvtepu8_epi32(
                _mm_loadu_si128((const __m128i *)(p + r * (cols / 2) + 16 * b)));
            __m512 sc = _mm512_set1_ps(stab[s[r * nb + b]]);
            __m512 w0 = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(d, low), lut), sc);
            __m512 w1 = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), lut), sc);
            for (int t = 0; t < TN; t++) {
                const float *xb = x + t * cols + b * 32;
                a[r][t][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xb), a[r][t][0]);
                a[r][t][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + 16), a[r][t][1]);
            }
        }
    float u[16], v[16];
    for (int r = 0; r < RN; r++)
        for (int t = 0; t < TN; t++) {
            _mm512_storeu_ps(u, a[r][t][0]);
            _mm512_storeu_ps(v, a[r][t][1]);
            y[t * ldy + r] = reduce(u, v);
        }
}
#else
#define SPLIT_X 0
static void tile(const uint8_t *p, const uint8_t *s, const float *stab, const float *x,
                 int64_t cols, float *y, int64_t ldy, const int RN, const int TN) {
    int64_t nb = cols / 32;
    for (int r = 0; r < RN; r++)
        for (int t = 0; t < TN; t++) {
            float a[16] = {0}, c[16] = {0};
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *pb = p + r * (cols / 2) + 16 * b;
                const float *xb = x + t * cols + b * 32, sc = stab[s[r * nb + b]];
                for (int j = 0; j < 16; j++) {
                    a[j] = fmaf(FP4[pb[j] & 15] * sc, xb[2 * j], a[j]);
                    c[j] = fmaf(FP4[pb[j] >> 4] * sc, xb[2 * j + 1], c[j]);
                }
            }
            y[t * ldy + r] = reduce(a, c);
        }
}
#endif
int reap_mxfp4_split_x(void) { return SPLIT_X; }
/* rows [r0, r1) of y [m, ldy] from p [rows, cols/2], s [rows, cols/32], x [m, cols] fp32 */
void reap_mxfp4_linear(const uint8_t *p, const uint8_t *s, const float *stab, const float *x,
                       float *y, int64_t r0, int64_t r1, int64_t ldy, int64_t cols, int64_t m) {
    int64_t hp = cols / 2, hs = cols / 32;
    for (int64_t t0 = 0; t0 < m; t0 += 4) {
        int tn = m - t0 < 4 ? (int)(m - t0) : 4;
        const float *xt = x + t0 * cols;
        float *yt = y + t0 * ldy;
        int64_t o = r0;
        if (tn == 1) /* one token: four rows at a time keep the FMA units busy */
            for (; o + 4 <= r1; o += 4)
                tile(p + o * hp, s + o * hs, stab, xt, cols, yt + o, ldy, 4, 1);
        for (; o < r1; o++) {
            const uint8_t *po = p + o * hp, *so = s + o * hs;
            if (tn == 1) tile(po, so, stab, xt, cols, yt + o, ldy, 1, 1);
            else if (tn == 2) tile(po, so, stab, xt, cols, yt + o, ldy, 1, 2);
            else if (tn == 3) tile(po, so, stab, xt, cols, yt + o, ldy, 1, 3);
            else tile(po, so, stab, xt, cols, yt + o, ldy, 1, 4);
        }
    }
}
"""
# no fp contraction: the kernels' roundings are the ones written (fmaf where fused)
_CC = ["cc", "-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC"]
_LIB: list = []  # [ctypes.CDLL or None] once tried
_LIB_LOCK = threading.Lock()


def _library():
    """The compiled C decoder, built once per source and machine; None if unavailable."""
    with _LIB_LOCK:
        if not _LIB:
            _LIB.append(None if os.environ.get("REAP_NO_CKERNEL") else _build())
        return _LIB[0]


def _build(flags: tuple[str, ...] = ()):
    """Compile the C source (with extra compiler `flags`) into the cache; the loaded library."""
    from reap.defaults import cache_dir

    cc = [*_CC, *flags]
    tag = hashlib.sha256((_C_SOURCE + " ".join(cc) + os.uname().machine).encode()).hexdigest()[:16]
    so = cache_dir() / "kernels" / f"mxfp4-{tag}.so"
    try:
        if not so.is_file():
            so.parent.mkdir(parents=True, exist_ok=True)
            # atomic: concurrent builds leave one complete file
            with tempfile.TemporaryDirectory(dir=so.parent) as tmp, atomic_path(so) as out:
                src = Path(tmp) / "k.c"
                src.write_text(_C_SOURCE)
                cmd = [*cc, "-o", out, str(src), "-lm"]
                subprocess.run(cmd, check=True, capture_output=True, timeout=120)
        lib = ctypes.CDLL(str(so))
    except (OSError, subprocess.SubprocessError, WriteError):
        return None  # no compiler or no write access: the torch path decodes
    for name in ("reap_decode_u32", "reap_decode_u64"):
        getattr(lib, name).restype = None
        getattr(lib, name).argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64]
    lib.reap_mxfp4_linear.restype = None
    lib.reap_mxfp4_linear.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 5
    lib.reap_mxfp4_split_x.restype = ctypes.c_int
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
    size = table.element_size()

    def run(a: int, b: int) -> None:
        ptrs = (packed.data_ptr() + 16 * a, scales.data_ptr() + a, table.data_ptr())
        fn(*ptrs, words.data_ptr() + 16 * a * size, b - a)

    _parallel(run, scales.numel(), 4096)


def _parallel(run, total: int, grain: int, align: int = 1) -> None:
    """run(a, b) over [0, total) split into decode_threads() ranges of at least `grain` items
    (cuts at multiples of `align`), each in its own thread (the C calls release the GIL)."""
    n = min(decode_threads(), max(1, total // grain))
    cuts = [min(total, total * i // n // align * align) for i in range(n)] + [total]
    if n == 1:
        run(0, total)
        return
    threads = [threading.Thread(target=run, args=(cuts[i], cuts[i + 1])) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


# -- fused MXFP4 linear ------------------------------------------------------------------------
FUSED_MAX_ROWS = 8  # rows of x up to which the fused kernel beats decode + dense matmul


def mxfp4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, lib=None):
    """x [..., I] @ W.T for the MXFP4 matrix W [O, I] (packed uint8 [O, I/2], E8M0 scales
    [O, I/32]) without decoding W to memory: [..., O] in x's dtype, accumulated in fp32 in the
    order `mxfp4_linear_reference` spells out (the same for a token alone or among others).
    None where the C kernel is unavailable (no compiler, REAP_NO_CKERNEL=1, not on CPU).
    `lib`: another build of the kernel (tests compare the vector and portable C paths)."""
    lib = lib or (_library() if x.device.type == "cpu" else None)
    if lib is None:
        return None
    rows, cols = packed.shape[0], 2 * packed.shape[1]
    xf = x.reshape(-1, cols).float()  # [M, I]
    m = xf.shape[0]
    if lib.reap_mxfp4_split_x():  # the vector kernel wants each block's even columns first
        xf = xf.reshape(m, cols // 32, 16, 2).transpose(-1, -2)  # [M, I/32, 2, 16]
    xf, packed, scales = xf.contiguous(), packed.contiguous(), scales.contiguous()
    y = torch.empty(m, rows)  # [M, O] fp32
    stab = mxfp4._SCALE_LUT

    def run(a: int, b: int) -> None:
        ptrs = (packed.data_ptr(), scales.data_ptr(), stab.data_ptr(), xf.data_ptr())
        lib.reap_mxfp4_linear(*ptrs, y.data_ptr(), a, b, rows, cols, m)

    _parallel(run, rows, 256, align=4)
    return y.to(x.dtype).reshape(*x.shape[:-1], rows)


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


_MATMULS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__}


class MXFP4Weight:
    """An MXFP4 matrix [O, I] handed to a model in place of its decoded weight. `x @ w.T` (how
    `reap.models.blocks.linear` applies a weight) and `F.linear(x, w)` with at most
    FUSED_MAX_ROWS rows of x run `mxfp4_linear`; any other use decodes it (`decode_mxfp4`,
    bit-identical to `reap.mxfp4.dequantize`) and proceeds with the dense tensor, so model code
    needs no change. `.to()` to its own dtype and device returns it unchanged."""

    ndim = 2

    def __init__(self, packed, scales, dtype, pool: BufferPool | None = None, transposed=False):
        self.packed, self.scales, self.dtype, self.pool = packed, scales, dtype, pool
        self.transposed, self.device = transposed, packed.device
        shape = (packed.shape[0], 2 * packed.shape[1])  # [O, I]
        self.shape = torch.Size(shape[::-1] if transposed else shape)

    def dense(self) -> torch.Tensor:
        """The decoded matrix ([O, I], or its transpose view)."""
        w = decode_mxfp4(self.packed, self.scales, self.dtype, self.pool)  # [O, I]
        return w.T if self.transposed else w

    @property
    def T(self) -> MXFP4Weight:
        return MXFP4Weight(self.packed, self.scales, self.dtype, self.pool, not self.transposed)

    def dim(self) -> int:
        return 2

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def to(self, *args, **kwargs):
        device, dtype = torch._C._nn._parse_to(*args, **kwargs)[:2]
        same_device = device is None or torch.device(device) == self.device
        if same_device and dtype in (None, self.dtype) and not kwargs.get("copy"):
            return self
        return self.dense().to(*args, **kwargs)

    def __getattr__(self, name: str):
        if name.startswith("__") or name in ("packed", "scales", "dtype", "pool", "transposed"):
            raise AttributeError(name)
        return getattr(self.dense(), name)  # any other tensor method: on the decoded matrix

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        y = _fused(func, args, kwargs)
        return y if y is not None else func(*_dense(args), **_dense(kwargs))


def _fused(func, args, kwargs) -> torch.Tensor | None:
    """`x @ W.T` or `F.linear(x, W)` on an MXFP4Weight W through the fused kernel, when the
    call is one of those and x has at most FUSED_MAX_ROWS rows; else None."""
    if len(args) != 2 or not isinstance(args[0], torch.Tensor):
        return None
    x, w = args
    if not isinstance(w, MXFP4Weight):
        return None
    if func in _MATMULS and not kwargs and w.transposed:  # x @ W.T
        cols = w.shape[0]
    elif func is torch.nn.functional.linear and not kwargs and not w.transposed:
        cols = w.shape[1]
    else:
        return None
    if x.dtype != w.dtype or x.dim() < 1 or x.shape[-1] != cols:
        return None
    if x.numel() > FUSED_MAX_ROWS * cols:
        return None
    return mxfp4_linear(x, w.packed, w.scales)


def _dense(obj):
    """args/kwargs with every MXFP4Weight replaced by its decoded matrix."""
    if isinstance(obj, MXFP4Weight):
        return obj.dense()
    if isinstance(obj, (list, tuple)):
        return type(obj)(_dense(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _dense(v) for k, v in obj.items()}
    return obj


def expert_weights(tensors: dict, dtype: torch.dtype, pool: BufferPool | None, fused: bool):
    """An expert's tensors by short name with each MXFP4 pair ("<w>_packed" + "<w>_scale")
    replaced by "<w>": an MXFP4Weight when `fused`, else the matrix decoded to `dtype`."""
    out = {}
    for name, v in tensors.items():
        if name.endswith("_packed"):
            base = name[: -len("_packed")]
            scale = tensors[base + "_scale"]
            w = MXFP4Weight(v, scale, dtype, pool)
            out[base] = w if fused else w.dense()
        elif not (name.endswith("_scale") and name[: -len("_scale")] + "_packed" in tensors):
            out[name] = v
    return out


def fused_available(dtype: torch.dtype, device: str) -> bool:
    """Whether experts run fused for this compute dtype: bf16/fp16 on a CPU with the C kernel
    (float32 keeps decode + dense matmul, equal bit for bit to the in-memory forward)."""
    return dtype in (torch.bfloat16, torch.float16) and device == "cpu" and _library() is not None


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
