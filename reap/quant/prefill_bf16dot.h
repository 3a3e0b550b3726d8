/* The many-token tiles on CPUs with bf16 dot products (AVX512_BF16), for bf16 weights times
   bf16 activations (`rnd`: every input the engine passes is then a bf16 value, so the bf16 copy
   of x is exact). One VDPBF16PS takes 32 columns: per fp32 lane i, the product of columns
   2i + 1 then the product of columns 2i, each added with one rounding (the products of two
   bf16 values are exact in fp32, so each step is fmaf; denormal inputs and results read and
   written as zero). An output: 16 lanes over the 32-column blocks in order, the lanes summed
   pairwise (v16_sum), the tail of n % 32 columns added in order (fmaf): the "pair order",
   which `tests/test_native_step.py` recomputes in torch. 2.5-3x fewer instructions than
   widening the weights for fp32 FMAs (prefill_kernels.c's TILE): on Zen 4 a 32-token bf16
   prefill of the 1 B Qwen3-MoE at 1 thread 1.25x faster (A/B of two trees, medians of 3). A
   CPU without these instructions, or a build without them (-mno-avx512bf16), keeps the widening
   tiles' order, the same on every such CPU. */
#ifndef REAP_PREFILL_BF16DOT_H
#define REAP_PREFILL_BF16DOT_H
#include "step_common.h"

#if defined(__AVX512BF16__) && REAP_SIMD == 512
#define REAP_BF16_DOT 1

/* x [n] bf16-valued fp32 -> its bf16 bits (exact) */
static void bf16_bits(const float *x, uint16_t *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, x + i, 4);
        y[i] = (uint16_t)(u >> 16);
    }
}

static inline __m512 dp32(__m512 acc, __m512i w, __m512i x) {
    return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x);
}

/* y[t * ldy + r] = pair-order dot of w row r and x row t, r < TR, t < NT: x16 the bf16 bits
   of x (rows ldx apart in both) */
#define DTILE(NAME, NT)                                                                       \
static void NAME(const uint16_t *w, const uint16_t *x16, const float *x, int64_t ldx,        \
                 int64_t n, float *y, int64_t ldy) {                                          \
    __m512 acc[TR][NT];                                                                       \
    for (int r = 0; r < TR; r++)                                                              \
        for (int t = 0; t < NT; t++) acc[r][t] = _mm512_setzero_ps();                         \
    int64_t c = 0;                                                                            \
    for (; c + 32 <= n; c += 32) {                                                            \
        __m512i wv[TR];                                                                       \
        for (int r = 0; r < TR; r++) {                                                        \
            const uint16_t *p = w + r * n + c;                                                \
            _mm_prefetch((const char *)(p + TR * n), _MM_HINT_T0); /* the next tile's rows */ \
            wv[r] = _mm512_loadu_si512(p);                                                    \
        }                                                                                     \
        for (int t = 0; t < NT; t++) {                                                        \
            __m512i xv = _mm512_loadu_si512(x16 + t * ldx + c);                               \
            V16_PIN(xv);                                                                      \
            for (int r = 0; r < TR; r++) acc[r][t] = dp32(acc[r][t], wv[r], xv);              \
        }                                                                                     \
    }                                                                                         \
    for (int r = 0; r < TR; r++)                                                              \
        for (int t = 0; t < NT; t++) {                                                        \
            float v = v16_sum(acc[r][t]);                                                     \
            for (int64_t k = c; k < n; k++) v = fmaf(widen(w[r * n + k]), x[t * ldx + k], v); \
            y[t * ldy + r] = v;                                                               \
        }                                                                                     \
}
DTILE(dtileT, TT)
DTILE(dtile4, 4)
DTILE(dtile3, 3)
DTILE(dtile2, 2)
DTILE(dtile1, 1)

typedef void (*dtile_fn)(const uint16_t *, const uint16_t *, const float *, int64_t, int64_t,
                         float *, int64_t);
static const dtile_fn DREST[5] = {0, dtile1, dtile2, dtile3, dtile4};

/* one output in the pair order (the rows past the last whole tile) */
static float dot_pairs(const uint16_t *w, const uint16_t *x16, const float *x, int64_t n) {
    __m512 a = _mm512_setzero_ps();
    int64_t c = 0;
    for (; c + 32 <= n; c += 32)
        a = dp32(a, _mm512_loadu_si512(w + c), _mm512_loadu_si512(x16 + c));
    float v = v16_sum(a);
    for (; c < n; c++) v = fmaf(widen(w[c]), x[c], v);
    return v;
}

/* `block` (prefill_kernels.c) in the pair order: rows [r0, r1), tokens [0, m) */
static void block_pairs(const uint16_t *w, const uint16_t *x16, const float *x, int64_t m,
                        int64_t n, int64_t r0, int64_t r1, float *y, int64_t ldy) {
    int64_t r = r0;
    for (; r + TR <= r1; r += TR) {
        int64_t t = 0;
        for (; t + TT <= m; t += TT)
            dtileT(w + r * n, x16 + t * n, x + t * n, n, n, y + t * ldy + r, ldy);
        for (; t < m; t += 4) {
            int64_t left = m - t < 4 ? m - t : 4;
            DREST[left](w + r * n, x16 + t * n, x + t * n, n, n, y + t * ldy + r, ldy);
        }
    }
    for (; r < r1; r++)
        for (int64_t t = 0; t < m; t++)
            y[t * ldy + r] = dot_pairs(w + r * n, x16 + t * n, x + t * n, n);
}
#endif
#endif
