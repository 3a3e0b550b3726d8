/* The AVX2 tiles of the many-token products (`prefill_kernels.c`): the same outputs as `dot1`
   bit for bit, shaped for 16 vector registers. An output's 16 lanes are two 8-lane halves
   here: a tile of HTR rows x HTT tokens holds one half of its 12 outputs, so it takes the
   columns in blocks of KB, each in two passes (lanes 0-7, then 8-15; the second pass reads the
   block from L1), and keeps its tokens' x in registers while the rows stream (the 2 x 3 tile
   of 16-lane pairs takes a load per FMA for x). From HALF_TOKENS tokens a matrix on they are
   ahead: 1.0-1.35x on products whose weights sit in cache, 1.05-1.1x on the routed experts
   with their weights read from memory (reports/step-kernels-avx2.md); below it, where the
   weights' first read from memory dominates, the pairs' tile was as fast or faster (the
   halves 0.8-0.9x at 4-8 tokens an expert). */
#ifndef REAP_PREFILL_AVX2_H
#define REAP_PREFILL_AVX2_H
#include "step_common.h"

#define HTR 4
#define HTT 3
#define KB 512
#define HALF_TOKENS 24

/* 8 weights of a row, widened */
static inline __m256 w8(const char *p, int bf16) {
    return bf16 ? widen8((const uint16_t *)p) : _mm256_loadu_ps((const float *)p);
}
/* acc[h][r][t] (lanes 8h to 8h + 7 of each output) over the 16-column groups in [c0, c1) */
#define HALF_PASS(NT, BF16, h)                                                                \
    do {                                                                                      \
        __m256 a[HTR][NT];                                                                    \
        for (int r = 0; r < HTR; r++)                                                         \
            for (int t = 0; t < NT; t++) a[r][t] = acc[h][r][t];                              \
        for (int64_t c = c0 + 8 * (h); c < c1; c += 16) {                                     \
            __m256 xv[NT];                                                                    \
            for (int t = 0; t < NT; t++) { /* loaded once, kept in a register */              \
                xv[t] = _mm256_loadu_ps(x + t * ldx + c);                                     \
                __asm__("" : "+x"(xv[t]));                                                    \
            }                                                                                 \
            for (int r = 0; r < HTR; r++) {                                                   \
                __m256 wv = w8(w + (r * n + c) * esz, BF16); /* (prefetching: slower) */      \
                for (int t = 0; t < NT; t++) a[r][t] = _mm256_fmadd_ps(wv, xv[t], a[r][t]);   \
            }                                                                                 \
        }                                                                                     \
        for (int r = 0; r < HTR; r++)                                                         \
            for (int t = 0; t < NT; t++) acc[h][r][t] = a[r][t];                              \
    } while (0)
#define HTILE(NAME, NT, BF16)                                                                 \
static void NAME(const char *w, int64_t esz, int wbf16, const float *x, int64_t ldx,          \
                 int64_t n, float *y, int64_t ldy) {                                          \
    (void)wbf16;                                                                              \
    __m256 acc[2][HTR][NT];                                                                   \
    for (int h = 0; h < 2; h++)                                                               \
        for (int r = 0; r < HTR; r++)                                                         \
            for (int t = 0; t < NT; t++) acc[h][r][t] = _mm256_setzero_ps();                  \
    int64_t end = n / 16 * 16;                                                                \
    for (int64_t c0 = 0; c0 < end; c0 += KB) {                                                \
        int64_t c1 = c0 + KB < end ? c0 + KB : end;                                           \
        HALF_PASS(NT, BF16, 0);                                                               \
        HALF_PASS(NT, BF16, 1);                                                               \
    }                                                                                         \
    for (int r = 0; r < HTR; r++)                                                             \
        for (int t = 0; t < NT; t++) { /* the halves' lanes summed as v16_sum, the tail */    \
            float v = v16_sum((v16){acc[0][r][t], acc[1][r][t]});                             \
            const char *p = w + r * n * esz;                                                  \
            for (int64_t k = end; k < n; k++) v = fmaf(load(p, BF16, k), x[t * ldx + k], v);  \
            y[t * ldy + r] = v;                                                               \
        }                                                                                     \
}
HTILE(htile3_f32, 3, 0)
HTILE(htile2_f32, 2, 0)
HTILE(htile1_f32, 1, 0)
HTILE(htile3_bf16, 3, 1)
HTILE(htile2_bf16, 2, 1)
HTILE(htile1_bf16, 1, 1)
#endif
