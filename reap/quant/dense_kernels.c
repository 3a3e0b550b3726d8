/* Dense bf16 matrix times a few fp32 rows, for decode: y[t, o] = sum_i x[t, i] * W[o, i] with
   W bf16 [rows, cols] widened exactly to fp32 (a 16-bit shift), x fp32, accumulated in fp32.
   Per (row, token): 16-lane accumulators over the columns in order (fmaf), then the lanes
   summed pairwise; a tail of cols % 16 columns is added in order after the lanes. Nothing
   depends on the token count or the row range, so a token's result is the same alone or in
   a batch and on any thread split. */
#include "step_common.h" /* v16, widen, round_bf16, lanes_sum: the step kernels' arithmetic */

#define TN_MAX 4
/* y[t * ldy] = W row . x[t] for t < tn (W bf16 if BF16, else fp32) */
#if defined(REAP_SIMD)
#define ROWS_TILE(NAME, T, BF16)                                                            \
static void NAME(const T *w, const float *x, int64_t cols, int64_t tn, float *y,            \
                 int64_t ldy) {                                                             \
    v16 a[TN_MAX];                                                                          \
    for (int t = 0; t < tn; t++) a[t] = v16_zero();                                         \
    int64_t c = 0;                                                                          \
    for (; c + 16 <= cols; c += 16) {                                                       \
        v16 wf = v16_w(w, BF16, c);                                                         \
        for (int t = 0; t < tn; t++) a[t] = v16_fma(wf, v16_f32(x + t * cols + c), a[t]);   \
    }                                                                                       \
    for (int t = 0; t < tn; t++) {                                                          \
        float v = v16_sum(a[t]);                                                            \
        for (int64_t k = c; k < cols; k++) v = fmaf(load(w, BF16, k), x[t * cols + k], v);  \
        y[t * ldy] = v;                                                                     \
    }                                                                                       \
}
#else
#define ROWS_TILE(NAME, T, BF16)                                                            \
static void NAME(const T *w, const float *x, int64_t cols, int64_t tn, float *y,            \
                 int64_t ldy) {                                                             \
    for (int t = 0; t < tn; t++) {                                                          \
        float a[16] = {0};                                                                  \
        int64_t c = 0;                                                                      \
        for (; c + 16 <= cols; c += 16)                                                     \
            for (int j = 0; j < 16; j++)                                                    \
                a[j] = fmaf(load(w, BF16, c + j), x[t * cols + c + j], a[j]);               \
        float v = lanes_sum(a);                                                             \
        for (int64_t k = c; k < cols; k++) v = fmaf(load(w, BF16, k), x[t * cols + k], v);  \
        y[t * ldy] = v;                                                                     \
    }                                                                                       \
}
#endif
ROWS_TILE(rows_tile, uint16_t, 1)
ROWS_TILE(rows_tile_f32, float, 0)

/* rows [r0, r1) of y [tokens, rows] = x [tokens, cols] @ W[rows, cols].T */
void reap_bf16_linear(const uint16_t *w, const float *x, float *y, int64_t r0, int64_t r1,
                      int64_t rows, int64_t cols, int64_t tokens) {
    for (int64_t t0 = 0; t0 < tokens; t0 += TN_MAX) {
        int64_t tn = tokens - t0 < TN_MAX ? tokens - t0 : TN_MAX;
        for (int64_t r = r0; r < r1; r++)
            rows_tile(w + r * cols, x + t0 * cols, cols, tn, y + t0 * rows + r, rows);
    }
}

/* the same with fp32 weights */
void reap_f32_linear(const float *w, const float *x, float *y, int64_t r0, int64_t r1,
                     int64_t rows, int64_t cols, int64_t tokens) {
    for (int64_t t0 = 0; t0 < tokens; t0 += TN_MAX) {
        int64_t tn = tokens - t0 < TN_MAX ? tokens - t0 : TN_MAX;
        for (int64_t r = r0; r < r1; r++)
            rows_tile_f32(w + r * cols, x + t0 * cols, cols, tn, y + t0 * rows + r, rows);
    }
}

/* The SwiGLU hidden of a few tokens for rows [r0, r1): h[t, r] = silu(gate_r . x_t) *
   (up_r . x_t), each dot product exactly the GEMV's (rows_tile, so nothing depends on the token
   count or the row range); with `bf16` every intermediate is rounded to bf16 where torch's
   bf16 ops round it (the two GEMV outputs, silu, the product). */
static inline float swiglu_one(float g, float u, int64_t bf16) {
    if (!bf16) return g / (1.0f + expf(-g)) * u;
    g = round_bf16(g);
    return round_bf16(round_bf16(g / (1.0f + expf(-g))) * round_bf16(u));
}
#define GATE_UP(NAME, T, TILE)                                                              \
void NAME(const T *wg, const T *wu, const float *x, float *h, int64_t r0, int64_t r1,      \
          int64_t rows, int64_t cols, int64_t tokens, int64_t bf16) {                       \
    float g[TN_MAX], u[TN_MAX];                                                             \
    for (int64_t t0 = 0; t0 < tokens; t0 += TN_MAX) {                                       \
        int64_t tn = tokens - t0 < TN_MAX ? tokens - t0 : TN_MAX;                           \
        for (int64_t r = r0; r < r1; r++) {                                                 \
            TILE(wg + r * cols, x + t0 * cols, cols, tn, g, 1);                             \
            TILE(wu + r * cols, x + t0 * cols, cols, tn, u, 1);                             \
            for (int64_t t = 0; t < tn; t++)                                                \
                h[(t0 + t) * rows + r] = swiglu_one(g[t], u[t], bf16);                      \
        }                                                                                   \
    }                                                                                       \
}
GATE_UP(reap_bf16_gate_up, uint16_t, rows_tile)
GATE_UP(reap_f32_gate_up, float, rows_tile_f32)
