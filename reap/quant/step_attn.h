/* The attention of the query heads that share one key/value head, over a KV cache
   (`step_kernels.c`: a decode token's groups, a prefill chunk's (group, token) pairs): scores
   k . q in one fixed order, a softmax, the probabilities times the values. A group's heads run
   together where the CPU allows (4 queries against each key row loaded, 4 heads' sums from
   each value row loaded), each head's values those of the plain per-head loops. */
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

/* The cache rows a group's loops read next, asked for ahead: the rows of a key/value head
   were written one or more tokens ago and are out of the caches by now in a decode step
   (behind the weights it streams), and the loops do too little per row for the hardware's
   prefetch to keep up (measured: 13 % less time for the 16 heads of a 512-token decode). */
#define PF_ROWS 8
/* rows [j, j + n) of those below `end` */
static inline void prefetch_rows(const void *rows, int bf16, int64_t dh, int64_t j, int64_t n,
                                 int64_t end) {
#if defined(__x86_64__)
    int64_t esz = bf16 ? 2 : 4, stop = (j + n < end ? j + n : end) * dh * esz;
    for (int64_t b = j * dh * esz; b < stop; b += 64)
        _mm_prefetch((const char *)rows + b, _MM_HINT_T0);
#else
    (void)rows, (void)bf16, (void)dh, (void)j, (void)n, (void)end;
#endif
}

/* weighted_rows of 4 heads over the same rows v: p + i * ps and o + i * dh for head i; 16
   columns a pass, each row loaded once for the 4 (same sums, same order) */
static void weighted_rows4(const float *p, int64_t ps, const void *v, int64_t n, int64_t dh,
                           int bf16, float *o) {
    int64_t d = 0;
#if defined(REAP_SIMD)
    for (; d + 16 <= dh; d += 16) {
        v16 a0 = v16_zero(), a1 = v16_zero(), a2 = v16_zero(), a3 = v16_zero();
        for (int64_t j = 0; j < n; j++) {
            if (d == 0 && j % 4 == 0) prefetch_rows(v, bf16, dh, j + PF_ROWS, 4, n);
            v16 vj = v16_w(v, bf16, j * dh + d);
            a0 = v16_add(a0, v16_mul(v16_set1(p[j]), vj));
            a1 = v16_add(a1, v16_mul(v16_set1(p[ps + j]), vj));
            a2 = v16_add(a2, v16_mul(v16_set1(p[2 * ps + j]), vj));
            a3 = v16_add(a3, v16_mul(v16_set1(p[3 * ps + j]), vj));
        }
        v16_store(o + d, a0);
        v16_store(o + dh + d, a1);
        v16_store(o + 2 * dh + d, a2);
        v16_store(o + 3 * dh + d, a3);
    }
#endif
    for (int i = 0; i < 4; i++)
        for (int64_t c = d; c < dh; c++) {
            float acc = 0.0f;
            for (int64_t j = 0; j < n; j++) acc += p[i * ps + j] * load(v, bf16, j * dh + c);
            o[i * dh + c] = acc;
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
/* tree8 of each of 8 accumulators, lane r the sum of a[r]: one transposing add tree */
static inline __m256 tree8x8(const __m256 *a) {
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}
static void scores8(const void *k, int bf16, const float *q, int64_t dh, int64_t j, float *s) {
    int64_t end = dh / 8 * 8;
    __m256 a[8];
    for (int r = 0; r < 8; r++) a[r] = _mm256_setzero_ps();
    for (int64_t c = 0; c < end; c += 8) {
        __m256 qv = _mm256_loadu_ps(q + c);
        for (int r = 0; r < 8; r++)
            a[r] = _mm256_fmadd_ps(load8(k, bf16, (j + r) * dh + c), qv, a[r]);
    }
    _mm256_storeu_ps(s + j, tree8x8(a));
}
/* keys j, j + 1 against 4 queries (q + i * dh) -> s[i * ss + j], s[i * ss + j + 1] */
static void scores2x4(const void *k, int bf16, const float *q, int64_t dh, int64_t j, float *s,
                      int64_t ss) {
    int64_t end = dh / 8 * 8;
    __m256 a[8];
    float out[8];
    for (int r = 0; r < 8; r++) a[r] = _mm256_setzero_ps();
    for (int64_t c = 0; c < end; c += 8) {
        __m256 k0 = load8(k, bf16, j * dh + c), k1 = load8(k, bf16, (j + 1) * dh + c);
        for (int i = 0; i < 4; i++) {
            __m256 qv = _mm256_loadu_ps(q + i * dh + c);
            a[2 * i] = _mm256_fmadd_ps(k0, qv, a[2 * i]);
            a[2 * i + 1] = _mm256_fmadd_ps(k1, qv, a[2 * i + 1]);
        }
    }
    _mm256_storeu_ps(out, tree8x8(a));
    for (int i = 0; i < 4; i++) {
        s[i * ss + j] = out[2 * i];
        s[i * ss + j + 1] = out[2 * i + 1];
    }
}
#endif
/* s[j] += the products of the columns past dh - dh % 8, in order, for keys j in [j0, j1) */
static void score_tails(const void *k, int bf16, const float *q, int64_t dh, int64_t j0,
                        int64_t j1, float *s) {
    for (int64_t j = j0; j < j1; j++)
        for (int64_t c = dh / 8 * 8; c < dh; c++)
            s[j] = fmaf(load(k, bf16, j * dh + c), q[c], s[j]);
}
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
    score_tails(k, bf16, q, dh, j0, j1, s);
}

/* `scores` of 4 queries (q + i * dh) -> s + i * ss: two keys at a time against the 4 on CPUs
   with AVX2 (each key row loaded once for the 4), the same values */
static void scores4(const void *k, int bf16, const float *q, int64_t dh, int64_t j0, int64_t j1,
                    float *s, int64_t ss) {
    int64_t j = j0;
#if defined(__AVX2__) && defined(__FMA__)
    for (; j + 2 <= j1; j += 2) {
        prefetch_rows(k, bf16, dh, j + PF_ROWS, 2, j1);
        scores2x4(k, bf16, q, dh, j, s, ss);
    }
    for (int i = 0; i < 4; i++) score_tails(k, bf16, q + i * dh, dh, j0, j, s + i * ss);
#endif
    for (int i = 0; i < 4; i++) scores(k, bf16, q + i * dh, dh, j, j1, s + i * ss);
}

/* scores s[first..S-1] -> probabilities: scaled, softmax (libm expf), rounded as torch */
static void softmax(const attn_t *t, float *s) {
    float m = -INFINITY, sum = 0.0f;
    for (int64_t j = t->first; j < t->S; j++) {
        s[j] = rb(s[j], t->rnd) * t->scale;
        if (s[j] > m) m = s[j];
    }
    for (int64_t j = t->first; j < t->S; j++) sum += (s[j] = expf(s[j] - m));
    for (int64_t j = t->first; j < t->S; j++) s[j] = rb(s[j] / sum, t->rnd);
}

/* the queries of key/value head g (heads g * group ..., at t->q + h * dh) over the keys
   first..S-1 -> t->o + h * dh; s: group * S scores */
static void attend_group(const attn_t *t, int64_t g, float *s) {
    int64_t esz = t->rnd ? 2 : 4, G = t->group, h0 = g * G, dh = t->dh, S = t->S, i = 0;
    const char *kb = (const char *)t->kc + g * t->cap * dh * esz;
    const char *vb = (const char *)t->vc + g * t->cap * dh * esz + t->first * dh * esz;
    for (; i + 4 <= G; i += 4)
        scores4(kb, t->rnd, t->q + (h0 + i) * dh, dh, t->first, S, s + i * S, S);
    for (; i < G; i++) scores(kb, t->rnd, t->q + (h0 + i) * dh, dh, t->first, S, s + i * S);
    for (i = 0; i < G; i++) softmax(t, s + i * S);
    float *o = t->o + h0 * dh;
    for (i = 0; i + 4 <= G; i += 4)
        weighted_rows4(s + i * S + t->first, S, vb, S - t->first, dh, t->rnd, o + i * dh);
    for (; i < G; i++)
        weighted_rows(s + i * S + t->first, vb, S - t->first, dh, t->rnd, o + i * dh);
    for (int64_t d = 0; d < G * dh; d++) o[d] = rb(o[d], t->rnd);
}

/* items: key/value heads; t->scores: H * S floats */
static void attn_task(const void *ctx, int64_t a, int64_t b) {
    const attn_t *t = (const attn_t *)ctx;
    for (int64_t g = a; g < b; g++) attend_group(t, g, t->scores + g * t->group * t->S);
}

#endif
