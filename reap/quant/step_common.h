/* What the step-kernel sources share (`step_pool.c`, `step_kernels.c`, `prefill_kernels.c`,
   compiled into one library), and the arithmetic helpers `dense_kernels.c` uses too: the
   thread pool's entry point and the arithmetic every kernel uses, one fixed order of fp32
   operations whatever the CPU (AVX-512, AVX2 or portable C). */
#ifndef REAP_STEP_COMMON_H
#define REAP_STEP_COMMON_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

/* fn(ctx, a, b) over [0, total) in chunks of at least `grain` items, shared by the caller and
   the pool's workers (step_pool.c); returns when all are done */
typedef void (*task_fn)(const void *ctx, int64_t a, int64_t b);
void reap_parallel(task_fn fn, const void *ctx, int64_t total, int64_t grain);

/* many-token products (prefill_kernels.c): y [n, rows] = x [n, cols] @ W.T for each matrix;
   x16, where given, the bf16 bits of a bf16-valued x (from reap_pair_bits) */
typedef struct {
    const void *w;
    float *y;
    int64_t rows;
} lin_mat;
void reap_linears(const float *x, const uint16_t *x16, int64_t n, int64_t cols, int wbf16,
                  const lin_mat *mats, int64_t count);
const uint16_t *reap_pair_bits(const float *x, int64_t n, uint16_t *x16);

static inline float widen(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* bf16 rounding of an fp32 value (round to nearest even, as torch's .to(bfloat16)) */
static inline float round_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return f;
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
}

static inline float rb(float f, int rnd) { return rnd ? round_bf16(f) : f; }

/* v16: 16 fp32 lanes, the unit every kernel's arithmetic is written in. One AVX-512 register,
   or two AVX2 registers (lanes 0-7, 8-15) on CPUs without AVX-512: the same operations lane by
   lane, so both compute the portable loops' values bit for bit (REAP_SIMD unset: plain C). */
#if defined(__AVX512F__)
#define REAP_SIMD 512
typedef __m512 v16;
static inline v16 v16_zero(void) { return _mm512_setzero_ps(); }
static inline v16 v16_set1(float f) { return _mm512_set1_ps(f); }
static inline v16 v16_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline v16 v16_bf16(const uint16_t *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline v16 v16_fma(v16 a, v16 b, v16 c) { return _mm512_fmadd_ps(a, b, c); }
static inline v16 v16_add(v16 a, v16 b) { return _mm512_add_ps(a, b); }
static inline v16 v16_mul(v16 a, v16 b) { return _mm512_mul_ps(a, b); }
static inline void v16_store(float *p, v16 v) { _mm512_storeu_ps(p, v); }
#define V16_PIN(v) __asm__("" : "+v"(v)) /* keep a loaded value in a register */
/* lanes_sum of the 16 lanes: the same pairwise adds, done lane-parallel */
static inline float v16_sum(v16 v) {
    const __m512i s8 = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 15, 14, 13, 12, 11, 10, 9, 8);
    const __m512i s4 = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 7, 6, 5, 4);
    const __m512i s2 = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 3, 2);
    const __m512i s1 = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 1);
    v = _mm512_add_ps(v, _mm512_permutexvar_ps(s8, v));
    v = _mm512_add_ps(v, _mm512_permutexvar_ps(s4, v));
    v = _mm512_add_ps(v, _mm512_permutexvar_ps(s2, v));
    v = _mm512_add_ps(v, _mm512_permutexvar_ps(s1, v));
    return _mm512_cvtss_f32(v);
}
#elif defined(__AVX2__) && defined(__FMA__)
#define REAP_SIMD 256
typedef struct {
    __m256 lo, hi;
} v16;
static inline __m256 widen8(const uint16_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline v16 v16_zero(void) { return (v16){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline v16 v16_set1(float f) { return (v16){_mm256_set1_ps(f), _mm256_set1_ps(f)}; }
static inline v16 v16_f32(const float *p) {
    return (v16){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
}
static inline v16 v16_bf16(const uint16_t *p) { return (v16){widen8(p), widen8(p + 8)}; }
static inline v16 v16_fma(v16 a, v16 b, v16 c) {
    return (v16){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
static inline v16 v16_add(v16 a, v16 b) {
    return (v16){_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)};
}
static inline v16 v16_mul(v16 a, v16 b) {
    return (v16){_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)};
}
static inline void v16_store(float *p, v16 v) {
    _mm256_storeu_ps(p, v.lo);
    _mm256_storeu_ps(p + 8, v.hi);
}
#define V16_PIN(v) ((void)0) /* 16 registers: the compiler places the loads */
/* lanes_sum of the 16 lanes: s[j] += s[j + 8], then + 4, + 2, + 1, as the plain C loop */
static inline float v16_sum(v16 v) {
    __m256 s = _mm256_add_ps(v.lo, v.hi);
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
}
#endif

#if defined(REAP_SIMD)
/* 16 weights from a bf16 or fp32 row */
static inline v16 v16_w(const void *p, int bf16, int64_t c) {
    return bf16 ? v16_bf16((const uint16_t *)p + c) : v16_f32((const float *)p + c);
}
#endif

static inline float lanes_sum(float *s) {
    for (int w = 8; w > 0; w >>= 1)
        for (int j = 0; j < w; j++) s[j] += s[j + w];
    return s[0];
}

static inline float load(const void *p, int bf16, int64_t i) {
    return bf16 ? widen(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* w (bf16 if wbf16, else fp32) . x over n columns: two sets of 16 fp32 lanes take alternate
   blocks of 16 columns (fmaf; a last odd block goes to the first set), the sets are added lane
   by lane, the lanes summed pairwise, then the tail of n % 16 columns added in order. Rows are
   left to the hardware prefetcher, which streams cache-line-aligned rows (the engine's
   buffers, `reap.checkpoint.files`): fp32 3-5 % faster than with software prefetch on Zen 3
   (AVX2), bf16 1.5x on Zen 4 (AVX-512, 1 thread; reports/llamacpp-avx512.md, notes). Only
   AVX2 bf16 prefetches the rows two ahead (a matrix-vector product walks rows in order): 6 %
   faster on Zen 3. */
static inline float dot(const void *w, int wbf16, const float *x, int64_t n) {
    int64_t c = 0;
#if defined(REAP_SIMD)
    v16 a = v16_zero(), b = v16_zero();
    if (wbf16) {
        const uint16_t *p = (const uint16_t *)w;
        for (; c + 32 <= n; c += 32) {
#if REAP_SIMD == 256
            _mm_prefetch((const char *)(p + 2 * n + c), _MM_HINT_T0);
#endif
            a = v16_fma(v16_bf16(p + c), v16_f32(x + c), a);
            b = v16_fma(v16_bf16(p + c + 16), v16_f32(x + c + 16), b);
        }
    } else {
        const float *p = (const float *)w;
        for (; c + 32 <= n; c += 32) {
            a = v16_fma(v16_f32(p + c), v16_f32(x + c), a);
            b = v16_fma(v16_f32(p + c + 16), v16_f32(x + c + 16), b);
        }
    }
    if (c + 16 <= n) {
        a = v16_fma(v16_w(w, wbf16, c), v16_f32(x + c), a);
        c += 16;
    }
    float v = v16_sum(v16_add(a, b)); /* = lanes_sum of the stored lanes */
#else
    float s[16], t[16];
    for (int j = 0; j < 16; j++) s[j] = t[j] = 0.0f;
    for (; c + 16 <= n; c += 16) {
        float *acc = (c / 16) % 2 ? t : s;
        for (int j = 0; j < 16; j++) acc[j] = fmaf(load(w, wbf16, c + j), x[c + j], acc[j]);
    }
    for (int j = 0; j < 16; j++) s[j] += t[j];
    float v = lanes_sum(s);
#endif
    for (; c < n; c++) v = fmaf(load(w, wbf16, c), x[c], v);
    return v;
}


static inline void store(void *p, int bf16, int64_t i, float v) {
    if (bf16) {
        uint32_t u;
        memcpy(&u, &v, 4); /* v is already a bf16 value */
        ((uint16_t *)p)[i] = (uint16_t)(u >> 16);
    } else {
        ((float *)p)[i] = v;
    }
}

/* y = rms_norm(x) * w over n (torch: x * rsqrt(mean(x^2) + eps), then * w, then rounded) */
static inline void rms_norm(const float *x, const void *w, int wbf16, float eps, int64_t n, float *y,
                     int rnd) {
    float s[16] = {0};
    int64_t c = 0;
    for (; c + 16 <= n; c += 16)
        for (int j = 0; j < 16; j++) s[j] = fmaf(x[c + j], x[c + j], s[j]);
    float ss = lanes_sum(s);
    for (; c < n; c++) ss = fmaf(x[c], x[c], ss);
    float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) y[i] = rb(x[i] * r * load(w, wbf16, i), rnd);
}


/* w . x over n columns for the many-token products (prefill_kernels.c): one set of 16 fp32
   lanes over the columns in order (fmaf), the lanes summed pairwise, the tail added in order. */
static inline float dot1(const void *w, int wbf16, const float *x, int64_t n) {
    float s[16];
    int64_t c = 0;
#if defined(REAP_SIMD)
    v16 a = v16_zero();
    for (; c + 16 <= n; c += 16) a = v16_fma(v16_w(w, wbf16, c), v16_f32(x + c), a);
    v16_store(s, a);
#else
    for (int j = 0; j < 16; j++) s[j] = 0.0f;
    for (; c + 16 <= n; c += 16)
        for (int j = 0; j < 16; j++) s[j] = fmaf(load(w, wbf16, c + j), x[c + j], s[j]);
#endif
    float v = lanes_sum(s);
    for (; c < n; c++) v = fmaf(load(w, wbf16, c), x[c], v);
    return v;
}


#endif
