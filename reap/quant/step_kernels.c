/* One decode token of a pre-norm decoder layer (RMSNorm, grouped-query RoPE attention over a
   KV cache, softmax top-k router, SwiGLU experts) in two calls, with a persistent thread pool
   that splits every matrix-vector product by rows; and the attention half of many tokens of
   one sequence (a prefill chunk) in one call, its products through the many-token tiles.

   Arithmetic: activations are fp32 buffers; with `rnd` every value is rounded to bf16 where the
   engine's torch path (bf16 compute) rounds it, so the two paths differ only in the order of a
   few reductions (norm means, attention). Every matrix-vector dot product is `dot()` below (the
   many-token products `dot1`, the attention scores `scores`), each one fixed order of fp32
   operations whatever the CPU (AVX-512, AVX2 or portable C): no result depends on the thread
   count, on how rows are split, or on the batch. */
#include <stdlib.h>
#include <time.h>

#include "step_args.h" /* the argument blocks: A_*, M_*, T_* */
#include "step_common.h"

/* the argument layout compiled in (the loader compares it with its own) */
const char *reap_arg_layout(void) { return REAP_ARG_LAYOUT; }

/* the vector width the arithmetic runs in: 512 (AVX-512), 256 (AVX2) or 0 (plain C) */
int reap_simd(void) {
#if defined(REAP_SIMD)
    return REAP_SIMD;
#else
    return 0;
#endif
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

/* rows [lo, hi) of one segment's matrix w: y[i] = rb(w_i . x) */
static void rows_of(const gemv_t *g, const void *w, const seg_t *s, int64_t lo, int64_t hi) {
    int64_t esz = g->wbf16 ? 2 : 4;
    for (int64_t i = lo; i < hi; i++)
        s->y[i] = rb(dot((const char *)w + i * g->cols * esz, g->wbf16, s->x, g->cols), g->rnd);
}

/* rows [a, b) of the concatenated segments: y = rb(W x), or with w2 the SwiGLU hidden
   rb(rb(silu(rb(g))) * rb(u)) (torch's bf16 ops round each of these). A pair reads its gate
   rows first (into y), then its up rows: one stream at a time, which the hardware prefetcher
   follows better than rows of the two matrices in turn (reports/llamacpp-zen4.md, notes). */
static void gemv_task(const void *ctx, int64_t a, int64_t b) {
    const gemv_t *g = (const gemv_t *)ctx;
    int64_t base = 0, esz = g->wbf16 ? 2 : 4;
    for (int k = 0; k < g->nseg && base < b; base += g->s[k].rows, k++) {
        const seg_t *s = &g->s[k];
        int64_t lo = (a > base ? a : base) - base;
        int64_t hi = (b < base + s->rows ? b : base + s->rows) - base;
        rows_of(g, s->w, s, lo, hi);
        if (!s->w2) continue;
        for (int64_t i = lo; i < hi; i++) {
            float u = dot((const char *)s->w2 + i * g->cols * esz, g->wbf16, s->x, g->cols);
            float gv = s->y[i];
            s->y[i] = rb(rb(gv / (1.0f + expf(-gv)), g->rnd) * rb(u, g->rnd), g->rnd);
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
        reap_parallel(gemv_task, g, total, 32);
}

static seg_t seg(const void *w, const float *x, float *y, int64_t rows) {
    seg_t s = {w, 0, x, y, rows};
    return s;
}

#include "step_attn.h" /* attn_t, attend_group, attn_task */

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

static void qk_norm(float *q, float *k, const int64_t *a, float eps) {
    int wb = (int)a[A_WBF16], rnd = (int)a[A_RND];
    int64_t H = a[A_HEADS], Hkv = a[A_KV_HEADS], Dh = a[A_DH];
    const void *qn = (const void *)a[A_Q_NORM], *kn = (const void *)a[A_K_NORM];
    if (a[A_QK] == 2) { /* over the whole projections */
        rms_norm(q, qn, wb, eps, H * Dh, q, rnd);
        rms_norm(k, kn, wb, eps, Hkv * Dh, k, rnd);
    } else if (a[A_QK] == 1) { /* per head */
        for (int64_t h = 0; h < H; h++) rms_norm(q + h * Dh, qn, wb, eps, Dh, q + h * Dh, rnd);
        for (int64_t h = 0; h < Hkv; h++) rms_norm(k + h * Dh, kn, wb, eps, Dh, k + h * Dh, rnd);
    }
}

/* A token's rounded q [H, Dh] and k [Hkv, Dh] at position pos: q/k norms, RoPE; then its k
   and v [Hkv, Dh] written into the cache at pos */
static void rotate_and_cache(float *q, float *k, const float *v, const int64_t *a, float eps,
                             int64_t pos) {
    int64_t Dh = a[A_DH], half = a[A_ROT] / 2;
    int rnd = (int)a[A_RND];
    const float *cs = (const float *)a[A_COS] + pos * half;
    const float *sn = (const float *)a[A_SIN] + pos * half;
    qk_norm(q, k, a, eps);
    rope(q, a[A_HEADS], Dh, a[A_ROT], cs, sn, rnd);
    rope(k, a[A_KV_HEADS], Dh, a[A_ROT], cs, sn, rnd);
    for (int64_t i = 0; i < a[A_KV_HEADS] * Dh; i++) {
        int64_t at = (i / Dh * a[A_CAP] + pos) * Dh + i % Dh;
        store((void *)a[A_KC], rnd, at, k[i]);
        store((void *)a[A_VC], rnd, at, v[i]);
    }
}

/* the first cache position a query at position S - 1 sees (a sliding window: the last
   `window`; 0: every position) */
static int64_t first_key(int64_t S, int64_t window) {
    return window > 0 && S > window ? S - window : 0;
}

/* Attention half of a layer for one token at cache position pos: h += o_proj(attn(norm(h)));
   x2 = post_norm(h); with a router, the top-k ids and weights (ascending ids). The new key and
   value are written into the cache at pos. f = {eps, scale}. */
void reap_attn_step(const int64_t *a, const double *f) {
    float *h = (float *)a[A_H], *x2 = (float *)a[A_X2], *sc = (float *)a[A_SCRATCH];
    int64_t D = a[A_D], H = a[A_HEADS], Hkv = a[A_KV_HEADS], Dh = a[A_DH], pos = a[A_POS];
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
    rotate_and_cache(q, k, v, a, eps, pos);
    int64_t S = pos + 1, first = first_key(S, a[A_WINDOW]);
    attn_t t = {q, (const void *)a[A_KC], (const void *)a[A_VC], o, rest, H / Hkv, a[A_CAP],
                Dh, first, S, (float)f[1], rnd};
    reap_parallel(attn_task, &t, Hkv, (1 << 15) / ((S - first) * Dh * (H / Hkv)) + 1);
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

/* ---- the attention half of many tokens of one sequence (a prefill chunk) ------------------ */
static void round_all(float *x, int64_t n, int rnd) {
    if (rnd)
        for (int64_t i = 0; i < n; i++) x[i] = round_bf16(x[i]);
}

typedef struct {
    attn_t base; /* the chunk's first token (q, o), the cache, the widths */
    int64_t n, heads, pos, window;
} pattn_t;

/* items g * n + t: token t's queries of key/value head g over the cache positions they see
   (the keys and values of the tokens before it and its own; a sliding window: the last
   `window`). The scores of an item need group * (pos + n) floats, allocated per task (NaN
   outputs if that fails). */
static void prefill_attn_task(const void *ctx, int64_t a, int64_t b) {
    const pattn_t *p = (const pattn_t *)ctx;
    int64_t G = p->base.group, dh = p->base.dh;
    float *s = (float *)malloc((size_t)(G * (p->pos + p->n)) * sizeof(float));
    for (int64_t it = a; it < b; it++) {
        int64_t g = it / p->n, t = it % p->n, S = p->pos + t + 1;
        attn_t one = p->base;
        one.q = p->base.q + t * p->heads * dh;
        one.o = p->base.o + t * p->heads * dh;
        one.S = S;
        one.first = first_key(S, p->window);
        if (s)
            attend_group(&one, g, s);
        else
            for (int64_t d = 0; d < G * dh; d++) one.o[g * G * dh + d] = NAN;
    }
    free(s);
}

/* The per-token steps of reap_attn_prefill (stage 0: input norm; 1: rounding, q/k norms, RoPE
   and the cache write of q, k, v; 2: residual and post norm; 3: the router's rounding and top
   k), tokens [lo, hi) of a pool job */
typedef struct {
    const int64_t *a;
    float *x, *q, *k, *v, *logits, *probs, eps;
    int stage;
} tok_t;

static void token_task(const void *ctx, int64_t lo, int64_t hi) {
    const tok_t *c = (const tok_t *)ctx;
    const int64_t *a = c->a;
    int64_t D = a[A_D], HD = a[A_HEADS] * a[A_DH], KV = a[A_KV_HEADS] * a[A_DH];
    int64_t E = a[A_E], K = a[A_K], pos = a[A_POS];
    int wb = (int)a[A_WBF16], rnd = (int)a[A_RND];
    float *h = (float *)a[A_H], *x2 = (float *)a[A_X2];
    for (int64_t t = lo; t < hi; t++) {
        float *qt = c->q + t * HD, *kt = c->k + t * KV, *vt = c->v + t * KV;
        switch (c->stage) {
        case 0:
            rms_norm(h + t * D, (const void *)a[A_IN_NORM], wb, c->eps, D, c->x + t * D, rnd);
            break;
        case 1:
            round_all(qt, HD, rnd);
            round_all(kt, KV, rnd);
            round_all(vt, KV, rnd);
            rotate_and_cache(qt, kt, vt, a, c->eps, pos + t);
            break;
        case 2:
            for (int64_t i = t * D; i < (t + 1) * D; i++) h[i] = rb(h[i] + rb(c->x[i], rnd), rnd);
            rms_norm(h + t * D, (const void *)a[A_POST_NORM], wb, c->eps, D, x2 + t * D, rnd);
            break;
        default:
            round_all(c->logits + t * E, E, rnd);
            route(c->logits + t * E, E, K, (int)a[A_RENORM], c->probs + t * E,
                  (int64_t *)a[A_IDS] + t * K, (float *)a[A_WEIGHTS] + t * K);
        }
    }
}

static void tokens(tok_t *c, int stage, int64_t n) {
    c->stage = stage;
    reap_parallel(token_task, c, n, 8);
}

/* The attention half of a layer for n tokens of one sequence at cache positions pos.. (a
   prefill chunk), each token's arithmetic reap_attn_step's with the products through the
   many-token tiles (one job for q, k and v): h [n, D] += o_proj(attn(in_norm(h))), the keys
   and values written into the cache, x2 [n, D] = post_norm(h) and, with a router, each
   token's top-k ids and weights [n, K] (ascending ids). f = {eps, scale}. Scratch:
   reap_attn_prefill_scratch floats. */
void reap_attn_prefill(const int64_t *a, const double *f, int64_t n) {
    int64_t D = a[A_D], H = a[A_HEADS], Hkv = a[A_KV_HEADS], Dh = a[A_DH], E = a[A_E], HD = H * Dh;
    int wb = a[A_WBF16] != 0, pairs = wb && a[A_RND]; /* bf16 values: the pair order */
    float *x = (float *)a[A_SCRATCH], *q = x + n * D, *k = q + n * (HD > E ? HD : E);
    float *v = k + n * Hkv * Dh, *o = v + n * Hkv * Dh, *probs = o + n * HD;
    uint16_t *x16 = (uint16_t *)(probs + n * E); /* the bf16 bits of each product's input */
    tok_t c = {a, x, q, k, v, q /* logits: q is done by then */, probs, (float)f[0], 0};
    tokens(&c, 0, n);
    lin_mat m[3] = {{(const void *)a[A_WQ], q, HD}, {(const void *)a[A_WK], k, Hkv * Dh},
                    {(const void *)a[A_WV], v, Hkv * Dh}};
    reap_linears(x, pairs ? reap_pair_bits(x, n * D, x16) : 0, n, D, wb, m, 3);
    tokens(&c, 1, n);
    pattn_t pa = {{q, (const void *)a[A_KC], (const void *)a[A_VC], o, 0, H / Hkv, a[A_CAP], Dh,
                   0, 0, (float)f[1], (int)a[A_RND]},
                  n, H, a[A_POS], a[A_WINDOW]};
    int64_t grain = (1 << 15) / ((a[A_POS] + n) * Dh * (H / Hkv)) + 1;
    reap_parallel(prefill_attn_task, &pa, Hkv * n, grain);
    lin_mat mo = {(const void *)a[A_WO], x, D}; /* x is done by then */
    reap_linears(o, pairs ? reap_pair_bits(o, n * HD, x16) : 0, n, HD, wb, &mo, 1);
    tokens(&c, 2, n);
    if (!a[A_ROUTER]) return;
    const float *x2 = (const float *)a[A_X2];
    lin_mat mr = {(const void *)a[A_ROUTER], c.logits, E};
    reap_linears(x2, pairs ? reap_pair_bits(x2, n * D, x16) : 0, n, D, wb, &mr, 1);
    tokens(&c, 3, n);
}

/* the scratch floats reap_attn_prefill needs for n tokens (its layer's arguments set) */
int64_t reap_attn_prefill_scratch(const int64_t *a, int64_t n) {
    int64_t D = a[A_D], HD = a[A_HEADS] * a[A_DH], KV = a[A_KV_HEADS] * a[A_DH], E = a[A_E];
    int64_t q = n * HD > n * E ? n * HD : n * E, bits = (n * (D > HD ? D : HD) + 1) / 2;
    return n * D + q + 2 * n * KV + n * HD + n * E + bits;
}

/* h[i] = rb(h[i] + rb(y[i])) for i < n: an MLP output y added to the residual stream */
void reap_residual(float *h, const float *y, int64_t n, int64_t rnd) {
    for (int64_t i = 0; i < n; i++) h[i] = rb(h[i] + rb(y[i], (int)rnd), (int)rnd);
}

/* The MLP half for one token: h += sum over k (in the given order, fp32) of weight_k *
   down_k(silu(gate_k x2) * up_k x2), each expert output rounded to the activation dtype, the
   sum rounded before the residual add (a dense MLP is one expert of weight 1). Expert k's
   output goes to scratch row K * F + k * D whatever else runs, so a token's experts may be
   computed over several calls: SKIP (a uint8 [K] or 0) marks those not computed in this call
   (1: computed by an earlier call, summed; 2: absent, neither), NOSUM leaves h untouched. */
void reap_moe_step(const int64_t *a) {
    const float *x2 = (const float *)a[M_X2], *wt = (const float *)a[M_WEIGHTS];
    float *h = (float *)a[M_H], *hid = (float *)a[M_SCRATCH];
    int64_t K = a[M_K], F = a[M_F], D = a[M_D];
    int wb = (int)a[M_WBF16], rnd = (int)a[M_RND];
    const int64_t *gp = (const int64_t *)a[M_GATE], *up = (const int64_t *)a[M_UP];
    const int64_t *dp = (const int64_t *)a[M_DOWN];
    const uint8_t *skip = (const uint8_t *)a[M_SKIP];
    float *out = hid + K * F;
    for (int64_t k0 = 0; k0 < K; k0 += MAX_SEG) {
        int64_t end = K - k0 < MAX_SEG ? K : k0 + MAX_SEG, n = 0, run[MAX_SEG];
        for (int64_t k = k0; k < end; k++)
            if (!skip || !skip[k]) run[n++] = k;
        if (!n) continue;
        gemv_t g = {.nseg = (int)n, .wbf16 = wb, .rnd = rnd, .cols = D};
        for (int64_t j = 0; j < n; j++) {
            g.s[j] = seg((const void *)gp[run[j]], x2, hid + run[j] * F, F);
            g.s[j].w2 = (const void *)up[run[j]];
        }
        run_gemv(&g);
        gemv_t d = {.nseg = (int)n, .wbf16 = wb, .rnd = rnd, .cols = F};
        for (int64_t j = 0; j < n; j++)
            d.s[j] = seg((const void *)dp[run[j]], hid + run[j] * F, out + run[j] * D, D);
        run_gemv(&d);
    }
    if (a[M_NOSUM]) return;
    for (int64_t i = 0; i < D; i++) {
        float y = 0.0f;
        for (int64_t k = 0; k < K; k++)
            if (!skip || skip[k] != 2) y += out[k * D + i] * wt[k];
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


/* ---- one token through every layer and the head ------------------------------------------- */

#define MAX_K 256

static double seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* A decode token of one sequence through all L layers, then the head: per layer exactly
   reap_attn_step(attn[i], f + 2i) then reap_moe_step over the routed experts' rows of
   tables[i] ([E, 3] gate/up/down pointers, every expert resident), or over the dense MLP
   (dense[i]: tables[i] holds its one triple); f_mlp[i] its width. moe: the MLP argument block
   (x2, h, scratch, d, wbf16, rnd set; the rest filled here). pos: the cache position written,
   set in every layer's block. emb: the token's embedding row (bf16 if emb_bf16, else fp32),
   cast into h as the engine casts it (rounded to bf16 with rnd), or 0: h holds the input.
   times[i] += layer i's seconds, times[L] += the head's; f[2L] is the final norm's eps. */
void reap_token_step(const int64_t *t, const double *f) {
    int64_t L = t[T_LAYERS];
    int64_t *const *attn = (int64_t *const *)t[T_ATTN];
    const int64_t *const *tables = (const int64_t *const *)t[T_TABLES];
    const int64_t *dense = (const int64_t *)t[T_DENSE], *width = (const int64_t *)t[T_F];
    double *times = (double *)t[T_TIMES];
    int64_t m[M_COUNT], gp[MAX_K], up[MAX_K], dp[MAX_K];
    float w[MAX_K];
    memcpy(m, (const int64_t *)t[T_MOE], sizeof m);
    m[M_GATE] = (int64_t)gp, m[M_UP] = (int64_t)up, m[M_DOWN] = (int64_t)dp;
    m[M_WEIGHTS] = (int64_t)w;
    float *h = (float *)m[M_H];
    for (int64_t i = 0; t[T_EMB] && i < m[M_D]; i++)
        h[i] = rb(load((const void *)t[T_EMB], (int)t[T_EMB_BF16], i), (int)m[M_RND]);
    for (int64_t i = 0; i < L; i++) attn[i][A_POS] = t[T_POS];
    for (int64_t i = 0; i < L; i++) {
        double t0 = seconds();
        const int64_t *a = attn[i], *tab = tables[i];
        reap_attn_step(a, f + 2 * i);
        int64_t K = dense[i] ? 1 : a[A_K];
        const int64_t *ids = (const int64_t *)a[A_IDS];
        const float *wts = (const float *)a[A_WEIGHTS];
        for (int64_t k = 0; k < K; k++) {
            int64_t e = dense[i] ? 0 : ids[k];
            gp[k] = tab[3 * e], up[k] = tab[3 * e + 1], dp[k] = tab[3 * e + 2];
            w[k] = dense[i] ? 1.0f : wts[k];
        }
        m[M_K] = K, m[M_F] = width[i];
        reap_moe_step(m);
        times[i] += seconds() - t0;
    }
    double t0 = seconds();
    reap_head_step((const float *)m[M_H], (const void *)t[T_NORM], (const void *)t[T_HEAD], t[T_V],
                   m[M_D], m[M_WBF16], m[M_RND], f[2 * L], (float *)t[T_X], (float *)t[T_LOGITS]);
    times[L] += seconds() - t0;
}
