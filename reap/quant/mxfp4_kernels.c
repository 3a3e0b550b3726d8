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
