/* The attention of one query over a KV cache (`step_kernels.c`: a decode token's heads, a
   prefill chunk's (head, token) pairs): scores k . q in one fixed order (8 keys at a time on
   AVX2, the plain loop's values), a softmax, the probabilities times the values. */
#ifndef REAP_STEP_ATTN_H
#define REAP_STEP_ATTN_H
#include "step_common.h"

/* ---- attention of one query over the cache ---------------------------------------------- */
typedef struct {
    const float *q; /* [H, Dh] */
    const void *kc, *vc; /* [Hkv, cap, Dh] in the activation dtype */
    float *o, *scores; /* [H, Dh], [H, S] */
    int64_t group, cap, dh, first, S;
    float scale;
    int rnd;
} attn_t;

/* o[d] = sum over j in order of p[j] * v[j][d] (a product, then an add: no fma), n rows of
   dh values (bf16 if bf16, else fp32); 64 columns a pass over the rows */
static void weighted_rows(const float *p, const void *v, int64_t n, int64_t dh, int bf16,
                          float *o) {
    int64_t d = 0;
#if defined(REAP_SIMD)
    for (; d + 64 <= dh; d += 64) {
        v16 a0 = v16_zero(), a1 = v16_zero(), a2 = v16_zero(), a3 = v16_zero();
        for (int64_t j = 0; j < n; j++) {
            v16 pj = v16_set1(p[j]);
            int64_t r = j * dh + d;
            a0 = v16_add(a0, v16_mul(pj, v16_w(v, bf16, r)));
            a1 = v16_add(a1, v16_mul(pj, v16_w(v, bf16, r + 16)));
            a2 = v16_add(a2, v16_mul(pj, v16_w(v, bf16, r + 32)));
            a3 = v16_add(a3, v16_mul(pj, v16_w(v, bf16, r + 48)));
        }
        v16_store(o + d, a0);
        v16_store(o + d + 16, a1);
        v16_store(o + d + 32, a2);
        v16_store(o + d + 48, a3);
    }
    for (; d + 16 <= dh; d += 16) {
        v16 acc = v16_zero();
        for (int64_t j = 0; j < n; j++)
            acc = v16_add(acc, v16_mul(v16_set1(p[j]), v16_w(v, bf16, j * dh + d)));
        v16_store(o + d, acc);
    }
#endif
    for (; d < dh; d++) {
        float acc = 0.0f;
        for (int64_t j = 0; j < n; j++) acc += p[j] * load(v, bf16, j * dh + d);
        o[d] = acc;
    }
}

/* ---- attention scores ------------------------------------------------------------------- */
/* s[j] = k_j . q for keys j in [j0, j1) (rows of dh values dh apart, bf16 if bf16, else fp32):
   8 fp32 lanes, lane l over the columns c = l mod 8 below dh - dh % 8 in order (fmaf), summed
   ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), then the last dh % 8 columns in order.
   Eight keys at a time on CPUs with AVX2 (their sums one transposing add tree: no reduction
   per key), the same values as the plain loop. */
static inline float tree8(const float *l) {
    return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}
#if defined(__AVX2__) && defined(__FMA__)
static inline __m256 load8(const void *p, int bf16, int64_t i) {
    if (!bf16) return _mm256_loadu_ps((const float *)p + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static void scores8(const void *k, int bf16, const float *q, int64_t dh, int64_t j, float *s) {
    int64_t end = dh / 8 * 8;
    __m256 a[8];
    for (int r = 0; r < 8; r++) a[r] = _mm256_setzero_ps();
    for (int64_t c = 0; c < end; c += 8) {
        __m256 qv = _mm256_loadu_ps(q + c);
        for (int r = 0; r < 8; r++) a[r] = _mm256_fmadd_ps(load8(k, bf16, (j + r) * dh + c), qv, a[r]);
    }
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    _mm256_storeu_ps(s + j, _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                                          _mm256_permute2f128_ps(u0, u1, 0x31)));
}
#endif
static void scores(const void *k, int bf16, const float *q, int64_t dh, int64_t j0, int64_t j1,
                   float *s) {
    int64_t end = dh / 8 * 8, j = j0;
#if defined(__AVX2__) && defined(__FMA__)
    for (; j + 8 <= j1; j += 8) scores8(k, bf16, q, dh, j, s);
#endif
    for (; j < j1; j++) {
        float l[8] = {0};
        for (int64_t c = 0; c < end; c++)
            l[c % 8] = fmaf(load(k, bf16, j * dh + c), q[c], l[c % 8]);
        s[j] = tree8(l);
    }
    for (j = j0; j < j1; j++)
        for (int64_t c = end; c < dh; c++) s[j] = fmaf(load(k, bf16, j * dh + c), q[c], s[j]);
}

/* head h's query (t->q + h * dh) over the keys first..S-1 -> t->o + h * dh; s: S scores */
static void attend(const attn_t *t, int64_t h, float *s) {
    int64_t esz = t->rnd ? 2 : 4, g = h / t->group;
    const char *kb = (const char *)t->kc + g * t->cap * t->dh * esz;
    const char *vb = (const char *)t->vc + g * t->cap * t->dh * esz;
    float m = -INFINITY, sum = 0.0f;
    scores(kb, t->rnd, t->q + h * t->dh, t->dh, t->first, t->S, s);
    for (int64_t j = t->first; j < t->S; j++) {
        s[j] = rb(s[j], t->rnd) * t->scale;
        if (s[j] > m) m = s[j];
    }
    for (int64_t j = t->first; j < t->S; j++) sum += (s[j] = expf(s[j] - m));
    for (int64_t j = t->first; j < t->S; j++) s[j] = rb(s[j] / sum, t->rnd);
    float *o = t->o + h * t->dh;
    weighted_rows(s + t->first, vb + t->first * t->dh * esz, t->S - t->first, t->dh, t->rnd, o);
    for (int64_t d = 0; d < t->dh; d++) o[d] = rb(o[d], t->rnd);
}

static void attn_task(const void *ctx, int64_t a, int64_t b) {
    const attn_t *t = (const attn_t *)ctx;
    for (int64_t h = a; h < b; h++) attend(t, h, t->scores + h * t->S);
}

#endif
