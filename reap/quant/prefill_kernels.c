/* The routed experts of many tokens (a prefill chunk) in one call: expert-major, (expert, row
   block) work items over the pool. Every output is `dot1` (step_common.h): one set of 16 fp32
   lanes over the columns in order, the lanes summed pairwise, the tail added in order; the
   register tiles below compute several outputs at once with exactly that sequence each, so no
   value depends on the batch, the tiling or the thread split. Experts with bf16 weights and
   bf16 activations on a CPU with bf16 dot products take the pair order instead
   (prefill_bf16dot.h), as independent of the batch, tiling and threads. */
#include <stdlib.h>

#include "step_args.h" /* P_*: reap_moe_prefill's argument block */
#include "step_common.h"

/* Tile shapes: rows per tile and tokens per full tile, sized to the vector registers (32
   AVX-512 registers hold 4 x 6 accumulators; 16 AVX2 ones hold 2 x 3 accumulator pairs) */
#if REAP_SIMD == 512
#define TR 4
#define TT 6
#else
#define TR 2
#define TT 3
#endif
#if REAP_SIMD == 256
#include "prefill_avx2.h" /* the half-lane tiles AVX2 takes for many tokens */
#endif
/* y[t * ldy + r] = dot1(w row r, x row t) for r < TR, t < NT (w rows of n columns, x rows of
   n floats, ldx apart); NT = TT tokens or the last 1-4 */
#if defined(REAP_SIMD)
#define TILE(NAME, NT, BF16)                                                                  \
static void NAME(const char *w, int64_t esz, int wbf16, const float *x, int64_t ldx,         \
                 int64_t n, float *y, int64_t ldy) {                                          \
    (void)wbf16;                                                                              \
    v16 acc[TR][NT];                                                                          \
    for (int r = 0; r < TR; r++)                                                              \
        for (int t = 0; t < NT; t++) acc[r][t] = v16_zero();                                  \
    int64_t c = 0;                                                                            \
    for (; c + 16 <= n; c += 16) {                                                            \
        v16 wv[TR];                                                                           \
        for (int r = 0; r < TR; r++) {                                                        \
            const char *p = w + (r * n + c) * esz;                                            \
            _mm_prefetch(p + TR * n * esz, _MM_HINT_T0); /* the next tile's rows */           \
            wv[r] = v16_w(p, BF16, 0);                                                        \
        }                                                                                     \
        for (int t = 0; t < NT; t++) {                                                        \
            v16 xv = v16_f32(x + t * ldx + c);                                                \
            V16_PIN(xv); /* one load per token, kept in a register */                         \
            for (int r = 0; r < TR; r++) acc[r][t] = v16_fma(wv[r], xv, acc[r][t]);           \
        }                                                                                     \
    }                                                                                         \
    for (int r = 0; r < TR; r++)                                                              \
        for (int t = 0; t < NT; t++) {                                                        \
            float v = v16_sum(acc[r][t]);                                                     \
            const char *p = w + r * n * esz;                                                  \
            for (int64_t k = c; k < n; k++) v = fmaf(load(p, BF16, k), x[t * ldx + k], v);   \
            y[t * ldy + r] = v;                                                               \
        }                                                                                     \
}
#else
#define TILE(NAME, NT, BF16)                                                                  \
static void NAME(const char *w, int64_t esz, int wbf16, const float *x, int64_t ldx,         \
                 int64_t n, float *y, int64_t ldy) {                                          \
    for (int r = 0; r < TR; r++)                                                              \
        for (int t = 0; t < NT; t++)                                                          \
            y[t * ldy + r] = dot1(w + r * n * esz, wbf16, x + t * ldx, n);                    \
}
#endif
TILE(tileT_f32, TT, 0)
TILE(tile4_f32, 4, 0)
TILE(tile3_f32, 3, 0)
TILE(tile2_f32, 2, 0)
TILE(tile1_f32, 1, 0)
TILE(tileT_bf16, TT, 1)
TILE(tile4_bf16, 4, 1)
TILE(tile3_bf16, 3, 1)
TILE(tile2_bf16, 2, 1)
TILE(tile1_bf16, 1, 1)

typedef void (*tile_fn)(const char *, int64_t, int, const float *, int64_t, int64_t, float *,
                        int64_t);

/* the full tile and the tiles of the last 1-4 tokens ([tokens][bf16], index 0 unused) of the
   16-lane tiles and, on AVX2, of the half-lane ones (prefill_avx2.h: 3 tokens a full tile, so
   only 1-2 are ever left) */
typedef struct {
    int64_t rows, tokens;
    tile_fn full[2], rest[5][2];
} tiles_t;
static const tiles_t PAIRS = {TR, TT, {tileT_f32, tileT_bf16},
                              {{0, 0}, {tile1_f32, tile1_bf16}, {tile2_f32, tile2_bf16},
                               {tile3_f32, tile3_bf16}, {tile4_f32, tile4_bf16}}};
#if REAP_SIMD == 256
static const tiles_t HALVES = {HTR, HTT, {htile3_f32, htile3_bf16},
                               {{0, 0}, {htile1_f32, htile1_bf16}, {htile2_f32, htile2_bf16}}};
#endif

#include "prefill_bf16dot.h" /* the pair-order tiles (bf16 dot products), where the CPU has them */

/* y[t, r] for rows [r0, r1) and tokens [0, m) of one matrix: tiles, then dot1 at the edges; in
   the pair order (block_pairs) where x16, the bf16 bits of x, is given */
static void block(const void *w, int wbf16, const float *x, const uint16_t *x16, int64_t m,
                  int64_t n, int64_t r0, int64_t r1, float *y, int64_t ldy) {
#if defined(REAP_BF16_DOT)
    if (x16) {
        block_pairs((const uint16_t *)w, x16, x, m, n, r0, r1, y, ldy);
        return;
    }
#endif
    (void)x16;
    const tiles_t *k = &PAIRS;
#if REAP_SIMD == 256
    if (m >= HALF_TOKENS) k = &HALVES;
#endif
    int64_t esz = wbf16 ? 2 : 4, r = r0, b = wbf16 != 0;
    for (; r + k->rows <= r1; r += k->rows) {
        const char *wr = (const char *)w + r * n * esz;
        int64_t t = 0;
        for (; t + k->tokens <= m; t += k->tokens)
            k->full[b](wr, esz, wbf16, x + t * n, n, n, y + t * ldy + r, ldy);
        for (; t < m; t += 4) { /* the last tokens (fewer than a full tile), at most 4 a tile */
            int64_t left = m - t < 4 ? m - t : 4;
            k->rest[left][b](wr, esz, wbf16, x + t * n, n, n, y + t * ldy + r, ldy);
        }
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
    uint16_t *xg16, *u16;  /* bf16 bits of xg and of the hidden u (pair order), or 0 */
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
            const float *x = p->xg + s * p->D;
            const uint16_t *x16 = p->xg16 ? p->xg16 + s * p->D : 0;
            block((const void *)w[0], p->wbf16, x, x16, m, p->D, r0, r1, g, p->F);
            block((const void *)w[1], p->wbf16, x, x16, m, p->D, r0, r1, u, p->F);
            for (int64_t t = 0; t < m; t++)
                for (int64_t r = r0; r < r1; r++) {
                    float gv = rb(g[t * p->F + r], p->rnd);
                    float sv = rb(gv / (1.0f + expf(-gv)), p->rnd);
                    u[t * p->F + r] = rb(sv * rb(u[t * p->F + r], p->rnd), p->rnd);
                }
        } else {
            int64_t r0 = blk * p->rows, r1 = r0 + p->rows < p->D ? r0 + p->rows : p->D;
            float *o = p->o + s * p->D;
            const uint16_t *u16 = p->u16 ? p->u16 + s * p->F : 0;
            block((const void *)w[2], p->wbf16, p->u + s * p->F, u16, m, p->F, r0, r1, o, p->D);
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
    sizes[1] = P * (2 * D + 2 * F) + (P * (D + F) + 1) / 2; /* + bf16 copies of xg and u */
}

typedef struct {
    const int64_t *ids, *pos;
    const float *wt, *o;
    float *y;
    int64_t K, D, add;
} acc_t;

/* y[t] = sum over t's routed slots, ascending expert id, of o[pair] * weight (fp32, product
   then sum, as the torch path's index_add_ of out * weight expert after expert), added to y's
   values if `add`, else from 0 */
static void acc_task(const void *ctx, int64_t a, int64_t b) {
    const acc_t *c = (const acc_t *)ctx;
    for (int64_t t = a; t < b; t++) {
        float *y = c->y + t * c->D;
        if (!c->add)
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
   table entry is 0 contribute nothing. With a[P_ADD], the sums continue from y's values (one
   expert per call, in ascending order, then gives one call's bits). Work items are (expert,
   row block) pairs. */
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
                    (int)a[P_RND], 0, 0, 0};
#if defined(REAP_BF16_DOT)
    if (pf.wbf16 && pf.rnd) { /* bf16 weights and bf16 values: the pair order */
        pf.xg16 = (uint16_t *)(o + P * D);
        pf.u16 = pf.xg16 + P * D;
        bf16_bits(xg, pf.xg16, start[E] * D);
    }
#endif
    for (int phase = 0; phase < 2; phase++) {
#if defined(REAP_BF16_DOT)
        if (phase == 1 && pf.u16) bf16_bits(u, pf.u16, start[E] * F);
#endif
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
        reap_parallel(prefill_task, &pf, n, 1);
    }
    acc_t ac = {ids, pos, (const float *)a[P_WEIGHTS], o, (float *)a[P_Y], K, D, a[P_ADD]};
    reap_parallel(acc_task, &ac, N, 16);
}


/* ---- a dense matrix times many rows (prefill projections) ---------------------------------- */
#define LIN_ROWS 32   /* weight rows per work item */
#define LIN_TOKENS 64 /* x rows per work item: a block of x stays in L2 while W rows stream */

typedef struct {
    const float *x;
    const lin_mat *mats;
    int64_t n, cols, count, items[4]; /* items[j]: work items before matrix j */
    int wbf16;
    const uint16_t *x16; /* the bf16 bits of x: the pair order (prefill_bf16dot.h), or 0 */
} linear_t;

static void linear_task(const void *ctx, int64_t a, int64_t b) {
    const linear_t *l = (const linear_t *)ctx;
    for (int64_t it = a; it < b; it++) { /* token block major: consecutive items share x */
        int64_t j = 0;
        while (it >= l->items[j + 1]) j++;
        const lin_mat *mt = l->mats + j;
        int64_t i = it - l->items[j], row_blocks = (mt->rows + LIN_ROWS - 1) / LIN_ROWS;
        int64_t t0 = i / row_blocks * LIN_TOKENS, r0 = i % row_blocks * LIN_ROWS;
        int64_t m = l->n - t0 < LIN_TOKENS ? l->n - t0 : LIN_TOKENS;
        int64_t r1 = r0 + LIN_ROWS < mt->rows ? r0 + LIN_ROWS : mt->rows;
        const uint16_t *x16 = l->x16 ? l->x16 + t0 * l->cols : 0;
        block(mt->w, l->wbf16, l->x + t0 * l->cols, x16, m, l->cols, r0, r1,
              mt->y + t0 * mt->rows, mt->rows);
    }
}

/* For each of `count` (at most 3) matrices W [rows, cols] (bf16 if wbf16, else fp32):
   y [n, rows] fp32 = x [n, cols] fp32 @ W.T, in one job over the pool. Every output is dot1
   (step_common.h), as the decode kernels' few-row products (dense_kernels.c), so a row's result
   does not depend on n, the blocking, the threads or the other matrices; with x16 (bf16 W and
   bf16-valued x, the bits from reap_pair_bits) the pair order instead. */
void reap_linears(const float *x, const uint16_t *x16, int64_t n, int64_t cols, int wbf16,
                  const lin_mat *mats, int64_t count) {
    linear_t l = {x, mats, n, cols, count, {0}, wbf16 != 0, x16};
    int64_t token_blocks = (n + LIN_TOKENS - 1) / LIN_TOKENS;
    for (int64_t j = 0; j < count; j++)
        l.items[j + 1] = l.items[j] + (mats[j].rows + LIN_ROWS - 1) / LIN_ROWS * token_blocks;
    reap_parallel(linear_task, &l, l.items[count], 1);
}

/* x16 = the bf16 bits of the bf16-valued x [n] where the build has bf16 dot products (the
   pair order: pass it to reap_linears); else 0, nothing written (the widening order) */
const uint16_t *reap_pair_bits(const float *x, int64_t n, uint16_t *x16) {
#if defined(REAP_BF16_DOT)
    bf16_bits(x, x16, n);
    return x16;
#else
    (void)x, (void)n, (void)x16;
    return 0;
#endif
}

/* y [n, rows] fp32 = x [n, cols] fp32 @ W[rows, cols].T (W bf16 if wbf16, else fp32): one
   matrix of `reap_linears` */
void reap_linear(const float *x, const void *w, float *y, int64_t n, int64_t rows, int64_t cols,
                 int64_t wbf16) {
    lin_mat m = {w, y, rows};
    reap_linears(x, 0, n, cols, (int)wbf16, &m, 1);
}

/* y [n, rows] = x [n, cols] @ W.T for bf16 W and bf16-valued fp32 x in the pair order
   (prefill_bf16dot.h), over the pool: the order's check (tests). Returns 0, writing nothing,
   where the build has no bf16 dot products (-1: no memory for x's bf16 copy). */
int reap_linear_pairs(const float *x, const uint16_t *w, float *y, int64_t n, int64_t rows,
                      int64_t cols) {
#if defined(REAP_BF16_DOT)
    uint16_t *x16 = (uint16_t *)malloc((size_t)(n * cols) * sizeof(uint16_t));
    if (!x16) return -1;
    lin_mat m = {w, y, rows};
    reap_linears(x, reap_pair_bits(x, n * cols, x16), n, cols, 1, &m, 1);
    free(x16);
    return 1;
#else
    (void)x, (void)w, (void)y, (void)n, (void)rows, (void)cols;
    return 0;
#endif
}
