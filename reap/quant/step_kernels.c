/* One decode token of a pre-norm decoder layer (RMSNorm, grouped-query RoPE attention over a
   KV cache, softmax top-k router, SwiGLU experts) in two calls, with a persistent thread pool
   that splits every matrix-vector product by rows.

   Arithmetic: activations are fp32 buffers; with `rnd` every value is rounded to bf16 where the
   engine's torch path (bf16 compute) rounds it, so the two paths differ only in the order of a
   few reductions (norm means, attention). Every dot product is `dot()` below, one fixed order
   of fp32 operations whatever the CPU (AVX-512 or portable C): no result depends on the thread
   count, on how rows are split, or on the batch. */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#define PAUSE() _mm_pause()
#else
#define PAUSE() ((void)0)
#endif

/* ---- thread pool ----------------------------------------------------------------------- */
/* A job is split into chunks that the caller and the workers claim from a shared ticket
   (job number << 32 | next chunk), so a worker that the OS has not scheduled yet delays
   nothing: the others take the chunks it has not claimed. Which thread computes a row never changes its value. */
typedef void (*task_fn)(const void *ctx, int64_t a, int64_t b);
#define MAX_THREADS 64
#define SPINS 20000 /* pause loops before an idle worker sleeps */
#define CLOSED 0xffffffffu

static struct {
    int n; /* threads including the caller */
    pthread_t th[MAX_THREADS];
    atomic_uint_fast64_t gen, ticket;
    atomic_int done, quit;
    int sleeping;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    task_fn fn;
    const void *ctx;
    int64_t total, chunk, nchunks;
} P = {.n = 1, .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

/* claim and run chunks of the open job until none is left */
static void run_chunks(void) {
    for (;;) {
        uint_fast64_t t = atomic_load_explicit(&P.ticket, memory_order_acquire);
        uint64_t c = t & 0xffffffffu;
        if (c == CLOSED || (int64_t)c >= P.nchunks) return;
        if (!atomic_compare_exchange_weak_explicit(&P.ticket, &t, t + 1, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue;
        int64_t a = (int64_t)c * P.chunk, b = a + P.chunk < P.total ? a + P.chunk : P.total;
        P.fn(P.ctx, a, b);
        atomic_fetch_add_explicit(&P.done, 1, memory_order_release);
    }
}

static uint_fast64_t start_gen; /* the generation when the workers were created */

static void *worker(void *arg) {
    (void)arg;
    uint_fast64_t seen = start_gen; /* not P.gen: a job may already have been posted */
    for (;;) {
        uint_fast64_t g;
        int spins = 0;
        while ((g = atomic_load_explicit(&P.gen, memory_order_acquire)) == seen) {
            if (++spins < SPINS) {
                PAUSE();
                continue;
            }
            pthread_mutex_lock(&P.mu);
            P.sleeping++;
            while (atomic_load(&P.gen) == seen) pthread_cond_wait(&P.cv, &P.mu);
            P.sleeping--;
            pthread_mutex_unlock(&P.mu);
        }
        seen = g;
        if (atomic_load(&P.quit)) return NULL;
        run_chunks();
    }
}

static void wake_all(void) {
    pthread_mutex_lock(&P.mu);
    atomic_fetch_add_explicit(&P.gen, 1, memory_order_release);
    if (P.sleeping) pthread_cond_broadcast(&P.cv);
    pthread_mutex_unlock(&P.mu);
}

/* Use n threads (the caller plus n - 1 workers); returns the count in use. */
int reap_pool_size(int n) {
    if (n < 1) n = 1;
    if (n > MAX_THREADS) n = MAX_THREADS;
    if (n == P.n) return n;
    if (P.n > 1) { /* stop the old workers */
        atomic_store(&P.quit, 1);
        wake_all();
        for (int i = 1; i < P.n; i++) pthread_join(P.th[i], NULL);
        atomic_store(&P.quit, 0);
    }
    P.n = 1;
    start_gen = atomic_load(&P.gen);
    for (int i = 1; i < n; i++) {
        if (pthread_create(&P.th[i], NULL, worker, NULL) != 0) break;
        P.n = i + 1;
    }
    return P.n;
}

/* fn(ctx, a, b) over [0, total) in chunks of at least `grain` items (about four per thread),
   shared by the caller and the workers; returns when all are done. */
static void parallel(task_fn fn, const void *ctx, int64_t total, int64_t grain) {
    if (total <= 0) return;
    int64_t chunk = total / (4 * (int64_t)P.n);
    chunk = chunk > grain ? chunk : grain;
    if (P.n == 1 || chunk >= total) {
        fn(ctx, 0, total);
        return;
    }
    uint_fast64_t job = (atomic_load(&P.ticket) >> 32) + 1;
    atomic_store_explicit(&P.ticket, job << 32 | CLOSED, memory_order_release);
    P.fn = fn;
    P.ctx = ctx;
    P.total = total;
    P.chunk = chunk;
    P.nchunks = (total + chunk - 1) / chunk;
    atomic_store_explicit(&P.done, 0, memory_order_relaxed);
    atomic_store_explicit(&P.ticket, job << 32, memory_order_release);
    wake_all();
    run_chunks();
    for (int spins = 0; atomic_load_explicit(&P.done, memory_order_acquire) < P.nchunks;)
        if (++spins < 256) PAUSE(); else sched_yield();
}

/* ---- arithmetic -------------------------------------------------------------------------- */
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

#if defined(__AVX512F__)
static inline __m512 widen16(const uint16_t *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

#if defined(__AVX512F__)
/* lanes_sum of a vector's 16 lanes, the same pairwise adds done lane-parallel */
static inline float lanes_sum16(__m512 v) {
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
#endif

static float lanes_sum(float *s) {
    for (int w = 8; w > 0; w >>= 1)
        for (int j = 0; j < w; j++) s[j] += s[j + w];
    return s[0];
}

static inline float load(const void *p, int bf16, int64_t i) {
    return bf16 ? widen(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* w (bf16 if wbf16, else fp32) . x over n columns: two sets of 16 fp32 lanes take alternate
   blocks of 16 columns (fmaf; a last odd block goes to the first set), the sets are added lane
   by lane, the lanes summed pairwise, then the tail of n % 16 columns added in order. The rows
   two ahead of w are prefetched (a matrix-vector product walks rows in order). */
static float dot(const void *w, int wbf16, const float *x, int64_t n) {
    float s[16];
    int64_t c = 0;
#if defined(__AVX512F__)
    __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
    if (wbf16) {
        const uint16_t *p = (const uint16_t *)w;
        for (; c + 32 <= n; c += 32) {
            _mm_prefetch((const char *)(p + 2 * n + c), _MM_HINT_T0);
            a = _mm512_fmadd_ps(widen16(p + c), _mm512_loadu_ps(x + c), a);
            b = _mm512_fmadd_ps(widen16(p + c + 16), _mm512_loadu_ps(x + c + 16), b);
        }
        if (c + 16 <= n) {
            a = _mm512_fmadd_ps(widen16(p + c), _mm512_loadu_ps(x + c), a);
            c += 16;
        }
    } else {
        const float *p = (const float *)w;
        for (; c + 32 <= n; c += 32) {
            _mm_prefetch((const char *)(p + 2 * n + c), _MM_HINT_T0);
            _mm_prefetch((const char *)(p + 2 * n + c + 16), _MM_HINT_T0);
            a = _mm512_fmadd_ps(_mm512_loadu_ps(p + c), _mm512_loadu_ps(x + c), a);
            b = _mm512_fmadd_ps(_mm512_loadu_ps(p + c + 16), _mm512_loadu_ps(x + c + 16), b);
        }
        if (c + 16 <= n) {
            a = _mm512_fmadd_ps(_mm512_loadu_ps(p + c), _mm512_loadu_ps(x + c), a);
            c += 16;
        }
    }
    _mm512_storeu_ps(s, _mm512_add_ps(a, b));
#else
    float t[16];
    for (int j = 0; j < 16; j++) s[j] = t[j] = 0.0f;
    for (; c + 16 <= n; c += 16) {
        float *acc = (c / 16) % 2 ? t : s;
        for (int j = 0; j < 16; j++) acc[j] = fmaf(load(w, wbf16, c + j), x[c + j], acc[j]);
    }
    for (int j = 0; j < 16; j++) s[j] += t[j];
#endif
    float v = lanes_sum(s);
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
static void rms_norm(const float *x, const void *w, int wbf16, float eps, int64_t n, float *y,
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

/* ---- row-split products ------------------------------------------------------------------ */
#define MAX_SEG 64
typedef struct {
    const void *w, *w2; /* matrix [rows, cols] (w2: the up matrix of a SwiGLU pair) */
    const float *x;     /* input [cols] */
    float *y;           /* output [rows] */
    int64_t rows;
} seg_t;
typedef struct {
    seg_t s[MAX_SEG];
    int nseg, wbf16, rnd;
    int64_t cols;
} gemv_t;

/* rows [a, b) of the concatenated segments: y = rb(W x), or with w2 the SwiGLU hidden
   rb(rb(silu(rb(g))) * rb(u)) (torch's bf16 ops round each of these) */
static void gemv_task(const void *ctx, int64_t a, int64_t b) {
    const gemv_t *g = (const gemv_t *)ctx;
    int64_t base = 0, esz = g->wbf16 ? 2 : 4;
    for (int k = 0; k < g->nseg && base < b; base += g->s[k].rows, k++) {
        const seg_t *s = &g->s[k];
        int64_t lo = a > base ? a : base, hi = b < base + s->rows ? b : base + s->rows;
        for (int64_t r = lo; r < hi; r++) {
            int64_t i = r - base;
            const char *wr = (const char *)s->w + i * g->cols * esz;
            float v = dot(wr, g->wbf16, s->x, g->cols);
            if (s->w2) {
                float u = dot((const char *)s->w2 + i * g->cols * esz, g->wbf16, s->x, g->cols);
                float gv = rb(v, g->rnd);
                v = rb(rb(gv / (1.0f + expf(-gv)), g->rnd) * rb(u, g->rnd), g->rnd);
            } else {
                v = rb(v, g->rnd);
            }
            s->y[i] = v;
        }
    }
}

#define SERIAL_BYTES (512 << 10) /* products reading less stay on the calling thread */

static void run_gemv(gemv_t *g) {
    int64_t total = 0;
    for (int k = 0; k < g->nseg; k++) total += g->s[k].rows;
    int64_t bytes = total * g->cols * (g->wbf16 ? 2 : 4) * (g->s[0].w2 ? 2 : 1);
    if (bytes < SERIAL_BYTES) /* a hand-off costs more than it saves, more so under load */
        gemv_task(g, 0, total);
    else
        parallel(gemv_task, g, total, 32);
}

static seg_t seg(const void *w, const float *x, float *y, int64_t rows) {
    seg_t s = {w, 0, x, y, rows};
    return s;
}

/* ---- attention of one query over the cache ---------------------------------------------- */
typedef struct {
    const float *q; /* [H, Dh] */
    const void *kc, *vc; /* [Hkv, cap, Dh] in the activation dtype */
    float *o, *scores; /* [H, Dh], [H, S] */
    int64_t group, cap, dh, first, S;
    float scale;
    int rnd;
} attn_t;

static void attn_task(const void *ctx, int64_t a, int64_t b) {
    const attn_t *t = (const attn_t *)ctx;
    int64_t esz = t->rnd ? 2 : 4;
    for (int64_t h = a; h < b; h++) {
        int64_t g = h / t->group;
        const char *kb = (const char *)t->kc + g * t->cap * t->dh * esz;
        const char *vb = (const char *)t->vc + g * t->cap * t->dh * esz;
        const float *q = t->q + h * t->dh;
        float *s = t->scores + h * t->S, m = -INFINITY, sum = 0.0f;
        for (int64_t j = t->first; j < t->S; j++) {
            s[j] = rb(dot(kb + j * t->dh * esz, t->rnd, q, t->dh), t->rnd) * t->scale;
            if (s[j] > m) m = s[j];
        }
        for (int64_t j = t->first; j < t->S; j++) sum += (s[j] = expf(s[j] - m));
        float *o = t->o + h * t->dh;
        for (int64_t d = 0; d < t->dh; d++) o[d] = 0.0f;
        for (int64_t j = t->first; j < t->S; j++) {
            float p = rb(s[j] / sum, t->rnd);
            const char *v = vb + j * t->dh * esz;
            for (int64_t d = 0; d < t->dh; d++) o[d] += p * load(v, t->rnd, d);
        }
        for (int64_t d = 0; d < t->dh; d++) o[d] = rb(o[d], t->rnd);
    }
}

/* rotate-half RoPE of `heads` heads [heads, dh] at one position (first `rot` dims) */
static void rope(float *x, int64_t heads, int64_t dh, int64_t rot, const float *cos,
                 const float *sin, int rnd) {
    int64_t half = rot / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *p = x + h * dh;
        for (int64_t i = 0; i < half; i++) {
            float a = p[i], b = p[i + half];
            p[i] = rb(a * cos[i] - b * sin[i], rnd);
            p[i + half] = rb(b * cos[i] + a * sin[i], rnd);
        }
    }
}

/* ---- softmax top-k router ------------------------------------------------------------------ */
/* probs = softmax(logits [E]); the K largest (earlier id first on ties), weights renormalized
   over them (summed largest first) if asked; written in ascending expert order. */
static void route(const float *logits, int64_t E, int64_t K, int renorm, float *probs,
                  int64_t *ids, float *weights) {
    float m = -INFINITY, sum = 0.0f;
    for (int64_t e = 0; e < E; e++) m = logits[e] > m ? logits[e] : m;
    for (int64_t e = 0; e < E; e++) sum += (probs[e] = expf(logits[e] - m));
    for (int64_t e = 0; e < E; e++) probs[e] /= sum;
    int64_t top[256];
    for (int64_t k = 0; k < K; k++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            int taken = 0;
            for (int64_t j = 0; j < k; j++) taken |= top[j] == e;
            if (!taken && (best < 0 || probs[e] > probs[best])) best = e;
        }
        top[k] = best;
    }
    float total = 0.0f;
    for (int64_t k = 0; k < K; k++) total += probs[top[k]];
    for (int64_t k = 0; k < K; k++) { /* ascending ids */
        int64_t pick = -1;
        for (int64_t j = 0; j < K; j++)
            if (top[j] >= 0 && (pick < 0 || top[j] < top[pick])) pick = j;
        ids[k] = top[pick];
        weights[k] = renorm ? probs[top[pick]] / total : probs[top[pick]];
        top[pick] = -1;
    }
}

/* ---- the two halves of a layer ------------------------------------------------------------ */
enum { /* reap_attn_step's int64 arguments */
    A_H, A_X2, A_SCRATCH, A_IN_NORM, A_WQ, A_WK, A_WV, A_WO, A_QNORM, A_KNORM, A_POST_NORM,
    A_ROUTER, A_COS, A_SIN, A_KC, A_VC, A_CAP, A_POS, A_D, A_H_, A_HKV, A_DH, A_ROT, A_QK,
    A_WINDOW, A_E, A_K, A_RENORM, A_WBF16, A_RND, A_IDS, A_WEIGHTS, A_N
};

static void qk_norm(float *q, float *k, const int64_t *a, float eps) {
    int wb = (int)a[A_WBF16], rnd = (int)a[A_RND];
    int64_t H = a[A_H_], Hkv = a[A_HKV], Dh = a[A_DH];
    const void *qn = (const void *)a[A_QNORM], *kn = (const void *)a[A_KNORM];
    if (a[A_QK] == 2) { /* over the whole projections */
        rms_norm(q, qn, wb, eps, H * Dh, q, rnd);
        rms_norm(k, kn, wb, eps, Hkv * Dh, k, rnd);
    } else if (a[A_QK] == 1) { /* per head */
        for (int64_t h = 0; h < H; h++) rms_norm(q + h * Dh, qn, wb, eps, Dh, q + h * Dh, rnd);
        for (int64_t h = 0; h < Hkv; h++) rms_norm(k + h * Dh, kn, wb, eps, Dh, k + h * Dh, rnd);
    }
}

/* Attention half of a layer for one token at cache position pos: h += o_proj(attn(norm(h)));
   x2 = post_norm(h); with a router, the top-k ids and weights (ascending ids). The new key and
   value are written into the cache at pos. f = {eps, scale}. */
void reap_attn_step(const int64_t *a, const double *f) {
    float *h = (float *)a[A_H], *x2 = (float *)a[A_X2], *sc = (float *)a[A_SCRATCH];
    int64_t D = a[A_D], H = a[A_H_], Hkv = a[A_HKV], Dh = a[A_DH], pos = a[A_POS];
    int wb = (int)a[A_WBF16], rnd = (int)a[A_RND];
    float eps = (float)f[0];
    float *x = sc, *q = x + D, *k = q + H * Dh, *v = k + Hkv * Dh, *o = v + Hkv * Dh;
    float *att = o + H * Dh, *rest = att + D;
    rms_norm(h, (const void *)a[A_IN_NORM], wb, eps, D, x, rnd);
    gemv_t g = {.nseg = 3, .wbf16 = wb, .rnd = rnd, .cols = D};
    g.s[0] = seg((const void *)a[A_WQ], x, q, H * Dh);
    g.s[1] = seg((const void *)a[A_WK], x, k, Hkv * Dh);
    g.s[2] = seg((const void *)a[A_WV], x, v, Hkv * Dh);
    run_gemv(&g);
    qk_norm(q, k, a, eps);
    int64_t half = a[A_ROT] / 2;
    const float *cs = (const float *)a[A_COS] + pos * half, *sn = (const float *)a[A_SIN] + pos * half;
    rope(q, H, Dh, a[A_ROT], cs, sn, rnd);
    rope(k, Hkv, Dh, a[A_ROT], cs, sn, rnd);
    for (int64_t gi = 0; gi < Hkv; gi++)
        for (int64_t d = 0; d < Dh; d++) {
            int64_t at = (gi * a[A_CAP] + pos) * Dh + d;
            store((void *)a[A_KC], rnd, at, k[gi * Dh + d]);
            store((void *)a[A_VC], rnd, at, v[gi * Dh + d]);
        }
    int64_t S = pos + 1, first = a[A_WINDOW] > 0 && S > a[A_WINDOW] ? S - a[A_WINDOW] : 0;
    attn_t t = {q, (const void *)a[A_KC], (const void *)a[A_VC], o, rest, H / Hkv, a[A_CAP],
                Dh, first, S, (float)f[1], rnd};
    parallel(attn_task, &t, H, (1 << 15) / ((S - first) * Dh) + 1);
    gemv_t go = {.nseg = 1, .wbf16 = wb, .rnd = rnd, .cols = H * Dh};
    go.s[0] = seg((const void *)a[A_WO], o, att, D);
    run_gemv(&go);
    for (int64_t i = 0; i < D; i++) h[i] = rb(h[i] + att[i], rnd);
    rms_norm(h, (const void *)a[A_POST_NORM], wb, eps, D, x2, rnd);
    if (!a[A_ROUTER]) return;
    float *logits = rest, *probs = rest + a[A_E];
    gemv_t gr = {.nseg = 1, .wbf16 = wb, .rnd = rnd, .cols = D};
    gr.s[0] = seg((const void *)a[A_ROUTER], x2, logits, a[A_E]);
    run_gemv(&gr);
    route(logits, a[A_E], a[A_K], (int)a[A_RENORM], probs, (int64_t *)a[A_IDS],
          (float *)a[A_WEIGHTS]);
}

enum { /* reap_moe_step's int64 arguments */
    M_X2, M_H, M_SCRATCH, M_K, M_F, M_D, M_WBF16, M_RND, M_WEIGHTS, M_GATE, M_UP, M_DOWN, M_N
};

/* The MLP half for one token: h += sum over k (in the given order, fp32) of weight_k *
   down_k(silu(gate_k x2) * up_k x2), each expert output rounded to the activation dtype, the
   sum rounded before the residual add (a dense MLP is one expert of weight 1). */
void reap_moe_step(const int64_t *a) {
    const float *x2 = (const float *)a[M_X2], *wt = (const float *)a[M_WEIGHTS];
    float *h = (float *)a[M_H], *hid = (float *)a[M_SCRATCH];
    int64_t K = a[M_K], F = a[M_F], D = a[M_D];
    int wb = (int)a[M_WBF16], rnd = (int)a[M_RND];
    const int64_t *gp = (const int64_t *)a[M_GATE], *up = (const int64_t *)a[M_UP];
    const int64_t *dp = (const int64_t *)a[M_DOWN];
    float *out = hid + K * F;
    for (int64_t k0 = 0; k0 < K; k0 += MAX_SEG) {
        int64_t n = K - k0 < MAX_SEG ? K - k0 : MAX_SEG;
        gemv_t g = {.nseg = (int)n, .wbf16 = wb, .rnd = rnd, .cols = D};
        for (int64_t k = 0; k < n; k++) {
            g.s[k] = seg((const void *)gp[k0 + k], x2, hid + (k0 + k) * F, F);
            g.s[k].w2 = (const void *)up[k0 + k];
        }
        run_gemv(&g);
        gemv_t d = {.nseg = (int)n, .wbf16 = wb, .rnd = rnd, .cols = F};
        for (int64_t k = 0; k < n; k++)
            d.s[k] = seg((const void *)dp[k0 + k], hid + (k0 + k) * F, out + (k0 + k) * D, D);
        run_gemv(&d);
    }
    for (int64_t i = 0; i < D; i++) {
        float y = 0.0f;
        for (int64_t k = 0; k < K; k++) y += out[k * D + i] * wt[k];
        h[i] = rb(h[i] + rb(y, rnd), rnd);
    }
}

/* Final norm and head: logits [V] = rb(head . rms_norm(h)) (fp32 out). */
void reap_head_step(const float *h, const void *norm, const void *head, int64_t V, int64_t D,
                    int64_t wbf16, int64_t rnd, double eps, float *x, float *logits) {
    rms_norm(h, norm, (int)wbf16, (float)eps, D, x, (int)rnd);
    gemv_t g = {.nseg = 1, .wbf16 = (int)wbf16, .rnd = (int)rnd, .cols = D};
    g.s[0] = seg(head, x, logits, V);
    run_gemv(&g);
}

/* ---- the routed experts of many tokens (prefill) ------------------------------------------- */
/* Every output here is `dot1`: one set of 16 fp32 lanes over the columns in order (fmaf), the
   lanes summed pairwise, the tail added in order; the tiles below compute several outputs at
   once with exactly that sequence each, so no value depends on the batch, the tiling or the
   thread split. */
static float dot1(const void *w, int wbf16, const float *x, int64_t n) {
    float s[16];
    int64_t c = 0;
#if defined(__AVX512F__)
    __m512 a = _mm512_setzero_ps();
    for (; c + 16 <= n; c += 16) {
        __m512 wv = wbf16 ? widen16((const uint16_t *)w + c) : _mm512_loadu_ps((const float *)w + c);
        a = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + c), a);
    }
    _mm512_storeu_ps(s, a);
#else
    for (int j = 0; j < 16; j++) s[j] = 0.0f;
    for (; c + 16 <= n; c += 16)
        for (int j = 0; j < 16; j++) s[j] = fmaf(load(w, wbf16, c + j), x[c + j], s[j]);
#endif
    float v = lanes_sum(s);
    for (; c < n; c++) v = fmaf(load(w, wbf16, c), x[c], v);
    return v;
}

#define TR 4 /* rows per tile */
/* y[t * ldy + r] = dot1(w row r, x row t) for r < TR, t < TT (w rows of n columns, x rows of
   n floats, ldx apart); TT = 6 or 4 tokens (24 or 16 accumulators) */
#if defined(__AVX512F__)
#define TILE(NAME, TT, BF16)                                                                  \
static void NAME(const char *w, int64_t esz, int wbf16, const float *x, int64_t ldx,         \
                 int64_t n, float *y, int64_t ldy) {                                          \
    (void)wbf16;                                                                              \
    __m512 acc[TR][TT];                                                                       \
    for (int r = 0; r < TR; r++)                                                              \
        for (int t = 0; t < TT; t++) acc[r][t] = _mm512_setzero_ps();                         \
    int64_t c = 0;                                                                            \
    for (; c + 16 <= n; c += 16) {                                                            \
        __m512 wv[TR];                                                                        \
        for (int r = 0; r < TR; r++) {                                                        \
            const char *p = w + (r * n + c) * esz;                                            \
            _mm_prefetch(p + TR * n * esz, _MM_HINT_T0); /* the next tile's rows */           \
            wv[r] = BF16 ? widen16((const uint16_t *)p) : _mm512_loadu_ps((const float *)p);  \
        }                                                                                     \
        for (int t = 0; t < TT; t++) {                                                        \
            __m512 xv = _mm512_loadu_ps(x + t * ldx + c);                                     \
            __asm__("" : "+v"(xv)); /* one load per token, kept in a register */             \
            for (int r = 0; r < TR; r++) acc[r][t] = _mm512_fmadd_ps(wv[r], xv, acc[r][t]);   \
        }                                                                                     \
    }                                                                                         \
    for (int r = 0; r < TR; r++)                                                              \
        for (int t = 0; t < TT; t++) {                                                        \
            float v = lanes_sum16(acc[r][t]);                                                 \
            const char *p = w + r * n * esz;                                                  \
            for (int64_t k = c; k < n; k++) v = fmaf(load(p, BF16, k), x[t * ldx + k], v);   \
            y[t * ldy + r] = v;                                                               \
        }                                                                                     \
}
#else
#define TILE(NAME, TT, BF16)                                                                  \
static void NAME(const char *w, int64_t esz, int wbf16, const float *x, int64_t ldx,         \
                 int64_t n, float *y, int64_t ldy) {                                          \
    for (int r = 0; r < TR; r++)                                                              \
        for (int t = 0; t < TT; t++)                                                          \
            y[t * ldy + r] = dot1(w + r * n * esz, wbf16, x + t * ldx, n);                    \
}
#endif
TILE(tile6_f32, 6, 0)
TILE(tile4_f32, 4, 0)
TILE(tile6_bf16, 6, 1)
TILE(tile4_bf16, 4, 1)

/* y[t, r] for rows [r0, r1) and tokens [0, m) of one matrix: tiles, then dot1 at the edges */
static void block(const void *w, int wbf16, const float *x, int64_t m, int64_t n, int64_t r0,
                  int64_t r1, float *y, int64_t ldy) {
    int64_t esz = wbf16 ? 2 : 4, r = r0;
    for (; r + TR <= r1; r += TR) {
        const char *wr = (const char *)w + r * n * esz;
        int64_t t = 0;
        for (; t + 6 <= m; t += 6)
            (wbf16 ? tile6_bf16 : tile6_f32)(wr, esz, wbf16, x + t * n, n, n, y + t * ldy + r, ldy);
        for (; t + 4 <= m; t += 4)
            (wbf16 ? tile4_bf16 : tile4_f32)(wr, esz, wbf16, x + t * n, n, n, y + t * ldy + r, ldy);
        for (; t < m; t++)
            for (int64_t q = r; q < r + TR; q++)
                y[t * ldy + q] = dot1((const char *)w + q * n * esz, wbf16, x + t * n, n);
    }
    for (; r < r1; r++)
        for (int64_t t = 0; t < m; t++)
            y[t * ldy + r] = dot1((const char *)w + r * n * esz, wbf16, x + t * n, n);
}

typedef struct {
    const int64_t *table;  /* [E, 3] gate, up, down pointers (0: skipped) */
    const int64_t *start;  /* [E + 1] first pair of each expert in the sorted order */
    const int64_t *items;  /* [n_items, 2] (expert, row block) */
    const float *xg;       /* [P, D] inputs gathered per pair */
    float *g, *u, *o;      /* [P, F] gate, [P, F] up then hidden, [P, D] outputs */
    int64_t F, D, rows;    /* rows per block */
    int wbf16, rnd, phase; /* phase 0: gate/up/hidden, 1: down */
} prefill_t;

static void prefill_task(const void *ctx, int64_t a, int64_t b) {
    const prefill_t *p = (const prefill_t *)ctx;
    for (int64_t it = a; it < b; it++) {
        int64_t e = p->items[2 * it], blk = p->items[2 * it + 1];
        int64_t s = p->start[e], m = p->start[e + 1] - s;
        const int64_t *w = p->table + 3 * e;
        if (p->phase == 0) {
            int64_t r0 = blk * p->rows, r1 = r0 + p->rows < p->F ? r0 + p->rows : p->F;
            float *g = p->g + s * p->F, *u = p->u + s * p->F;
            block((const void *)w[0], p->wbf16, p->xg + s * p->D, m, p->D, r0, r1, g, p->F);
            block((const void *)w[1], p->wbf16, p->xg + s * p->D, m, p->D, r0, r1, u, p->F);
            for (int64_t t = 0; t < m; t++)
                for (int64_t r = r0; r < r1; r++) {
                    float gv = rb(g[t * p->F + r], p->rnd);
                    float sv = rb(gv / (1.0f + expf(-gv)), p->rnd);
                    u[t * p->F + r] = rb(sv * rb(u[t * p->F + r], p->rnd), p->rnd);
                }
        } else {
            int64_t r0 = blk * p->rows, r1 = r0 + p->rows < p->D ? r0 + p->rows : p->D;
            float *o = p->o + s * p->D;
            block((const void *)w[2], p->wbf16, p->u + s * p->F, m, p->F, r0, r1, o, p->D);
            for (int64_t t = 0; t < m; t++)
                for (int64_t r = r0; r < r1; r++) o[t * p->D + r] = rb(o[t * p->D + r], p->rnd);
        }
    }
}

#define ROWS_F 32 /* gate/up rows per work item */
#define ROWS_D 64 /* down rows per work item */

/* scratch sizes of reap_moe_prefill: ints[0] int64 and ints[1] floats */
void reap_moe_prefill_scratch(int64_t N, int64_t K, int64_t E, int64_t F, int64_t D,
                              int64_t *sizes) {
    int64_t P = N * K, blocks = (F + ROWS_F - 1) / ROWS_F + (D + ROWS_D - 1) / ROWS_D;
    sizes[0] = (E + 1) + 2 * P + 2 * E * blocks;
    sizes[1] = P * (2 * D + 2 * F);
}

enum { /* reap_moe_prefill's int64 arguments */
    P_X, P_Y, P_IDS, P_WEIGHTS, P_TABLE, P_N, P_K, P_E, P_F, P_D, P_WBF16, P_RND, P_FLOATS,
    P_INTS, P_COUNT
};

typedef struct {
    const int64_t *ids, *pos;
    const float *wt, *o;
    float *y;
    int64_t K, D;
} acc_t;

/* y[t] = sum over t's routed slots, ascending expert id, of o[pair] * weight (fp32, product
   then sum, as the torch path's index_add_ of out * weight expert after expert) */
static void acc_task(const void *ctx, int64_t a, int64_t b) {
    const acc_t *c = (const acc_t *)ctx;
    for (int64_t t = a; t < b; t++) {
        float *y = c->y + t * c->D;
        for (int64_t d = 0; d < c->D; d++) y[d] = 0.0f;
        int64_t done[256], n = 0; /* slots in ascending expert order */
        for (int64_t k = 0; k < c->K; k++) {
            if (c->pos[t * c->K + k] < 0) continue;
            int64_t j = n++;
            while (j > 0 && c->ids[t * c->K + done[j - 1]] > c->ids[t * c->K + k]) {
                done[j] = done[j - 1];
                j--;
            }
            done[j] = k;
        }
        for (int64_t j = 0; j < n; j++) {
            const float *o = c->o + c->pos[t * c->K + done[j]] * c->D;
            float w = c->wt[t * c->K + done[j]];
            for (int64_t d = 0; d < c->D; d++) y[d] += o[d] * w;
        }
    }
}

/* The routed experts of N tokens: y [N, D] fp32 = per token the weighted sum (ascending expert
   order) of its experts' SwiGLU outputs, each rounded to the activation dtype; experts whose
   table entry is 0 contribute nothing. Work items are (expert, row block) pairs. */
void reap_moe_prefill(const int64_t *a) {
    int64_t N = a[P_N], K = a[P_K], E = a[P_E], F = a[P_F], D = a[P_D], P = N * K;
    const int64_t *ids = (const int64_t *)a[P_IDS], *table = (const int64_t *)a[P_TABLE];
    const float *x = (const float *)a[P_X];
    int64_t *start = (int64_t *)a[P_INTS], *order = start + E + 1, *pos = order + P;
    int64_t *items = pos + P;
    float *xg = (float *)a[P_FLOATS], *g = xg + P * D, *u = g + P * F, *o = u + P * F;
    for (int64_t e = 0; e <= E; e++) start[e] = 0;
    for (int64_t p = 0; p < P; p++)
        if (table[3 * ids[p]]) start[ids[p] + 1]++;
    for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
    int64_t *fill = items; /* borrowed: next free position per expert */
    for (int64_t e = 0; e < E; e++) fill[e] = start[e];
    for (int64_t p = 0; p < P; p++) { /* pairs by expert, then token */
        pos[p] = table[3 * ids[p]] ? fill[ids[p]]++ : -1;
        if (pos[p] >= 0) order[pos[p]] = p;
    }
    for (int64_t q = 0; q < start[E]; q++)
        memcpy(xg + q * D, x + (order[q] / K) * D, (size_t)D * sizeof(float));
    prefill_t pf = {table, start, items, xg, g, u, o, F, D, ROWS_F, (int)a[P_WBF16],
                    (int)a[P_RND], 0};
    for (int phase = 0; phase < 2; phase++) {
        int64_t rows = phase ? ROWS_D : ROWS_F, width = phase ? D : F, n = 0;
        for (int64_t e = 0; e < E; e++)
            if (start[e + 1] > start[e])
                for (int64_t blk = 0; blk * rows < width; blk++) {
                    items[2 * n] = e;
                    items[2 * n + 1] = blk;
                    n++;
                }
        pf.phase = phase;
        pf.rows = rows;
        parallel(prefill_task, &pf, n, 1);
    }
    acc_t ac = {ids, pos, (const float *)a[P_WEIGHTS], o, (float *)a[P_Y], K, D};
    parallel(acc_task, &ac, N, 16);
}
