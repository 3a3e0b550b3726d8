#include "step_common.h" /* v16: 16 fp32 lanes on AVX-512 or AVX2 */
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
#if defined(REAP_SIMD)
#define SPLIT_X 1 /* x arrives with each block's even columns first, then its odd ones */
#if REAP_SIMD == 512
#define MX_RN 4 /* rows of a one-token tile */
#define MX_TN 4 /* tokens of a one-row tile */
/* the 16 bytes' low nibbles (w[0]) and high nibbles (w[1]) as FP4 values times sc */
static inline void nibbles(const uint8_t *p, float sc, v16 *w) {
    const __m512 lut = _mm512_loadu_ps(FP4);
    __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    __m512 s = _mm512_set1_ps(sc);
    w[0] = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(d, _mm512_set1_epi32(15)), lut), s);
    w[1] = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), lut), s);
}
#else
#define MX_RN 2
#define MX_TN 2
/* FP4[i] for 8 indices 0-15: the table's two halves, chosen by bit 3 */
static inline __m256 fp4_8(__m256i i) {
    __m256 lo = _mm256_permutevar8x32_ps(_mm256_loadu_ps(FP4), i);
    __m256 hi = _mm256_permutevar8x32_ps(_mm256_loadu_ps(FP4 + 8), i);
    return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(i, 28)));
}
static inline void nibbles(const uint8_t *p, float sc, v16 *w) {
    __m256i d0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    __m256i d1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)));
    __m256i low = _mm256_set1_epi32(15);
    __m256 s = _mm256_set1_ps(sc);
    w[0].lo = _mm256_mul_ps(fp4_8(_mm256_and_si256(d0, low)), s);
    w[0].hi = _mm256_mul_ps(fp4_8(_mm256_and_si256(d1, low)), s);
    w[1].lo = _mm256_mul_ps(fp4_8(_mm256_srli_epi32(d0, 4)), s);
    w[1].hi = _mm256_mul_ps(fp4_8(_mm256_srli_epi32(d1, 4)), s);
}
#endif
static inline __attribute__((always_inline)) void tile(
    const uint8_t *p, const uint8_t *s, const float *stab, const float *x, int64_t cols,
    float *y, int64_t ldy, const int RN, const int TN) {
    v16 a[MX_RN][MX_TN][2];
    int64_t nb = cols / 32;
    for (int r = 0; r < RN; r++)
        for (int t = 0; t < TN; t++) a[r][t][0] = a[r][t][1] = v16_zero();
    for (int64_t b = 0; b < nb; b++)
        for (int r = 0; r < RN; r++) {
            v16 w[2];
            nibbles(p + r * (cols / 2) + 16 * b, stab[s[r * nb + b]], w);
            for (int t = 0; t < TN; t++) {
                const float *xb = x + t * cols + b * 32;
                a[r][t][0] = v16_fma(w[0], v16_f32(xb), a[r][t][0]);
                a[r][t][1] = v16_fma(w[1], v16_f32(xb + 16), a[r][t][1]);
            }
        }
    for (int r = 0; r < RN; r++)
        for (int t = 0; t < TN; t++) y[t * ldy + r] = v16_sum(v16_add(a[r][t][0], a[r][t][1]));
}
#else
#define SPLIT_X 0
#define MX_RN 4
#define MX_TN 4
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
            for (int j = 0; j < 16; j++) a[j] += c[j];
            y[t * ldy + r] = lanes_sum(a);
        }
}
#endif
int reap_mxfp4_split_x(void) { return SPLIT_X; }
/* rows [r0, r1) of y [m, ldy] from p [rows, cols/2], s [rows, cols/32], x [m, cols] fp32 */
void reap_mxfp4_linear(const uint8_t *p, const uint8_t *s, const float *stab, const float *x,
                       float *y, int64_t r0, int64_t r1, int64_t ldy, int64_t cols, int64_t m) {
    int64_t hp = cols / 2, hs = cols / 32;
    for (int64_t t0 = 0; t0 < m; t0 += MX_TN) {
        int tn = m - t0 < MX_TN ? (int)(m - t0) : MX_TN;
        const float *xt = x + t0 * cols;
        float *yt = y + t0 * ldy;
        int64_t o = r0;
        if (tn == 1) /* one token: several rows at a time keep the FMA units busy */
            for (; o + MX_RN <= r1; o += MX_RN)
                tile(p + o * hp, s + o * hs, stab, xt, cols, yt + o, ldy, MX_RN, 1);
        for (; o < r1; o++) {
            const uint8_t *po = p + o * hp, *so = s + o * hs;
            if (tn == 1) tile(po, so, stab, xt, cols, yt + o, ldy, 1, 1);
            else if (tn == 2) tile(po, so, stab, xt, cols, yt + o, ldy, 1, 2);
#if MX_TN > 2
            else if (tn == 3) tile(po, so, stab, xt, cols, yt + o, ldy, 1, 3);
            else tile(po, so, stab, xt, cols, yt + o, ldy, 1, 4);
#endif
        }
    }
}
