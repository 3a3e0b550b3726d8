/* The int64 argument blocks of the step kernels, field names in index order: the one place the
   layout is written. C gets enums from these lists (A_H, ..., A_COUNT; M_*, T_*, P_*); Python
   reads this file (`reap.quant.ckernel.ARGS`, names in lower case) and checks a loaded
   library's `reap_arg_layout()` against it before any call. */
#ifndef REAP_STEP_ARGS_H
#define REAP_STEP_ARGS_H

#define REAP_ATTN_ARGS(arg) /* reap_attn_step, reap_attn_prefill */                          \
    arg(H) arg(X2) arg(SCRATCH) arg(IN_NORM) arg(WQ) arg(WK) arg(WV) arg(WO) arg(Q_NORM)     \
    arg(K_NORM) arg(POST_NORM) arg(ROUTER) arg(COS) arg(SIN) arg(KC) arg(VC) arg(CAP)        \
    arg(POS) arg(D) arg(HEADS) arg(KV_HEADS) arg(DH) arg(ROT) arg(QK) arg(WINDOW) arg(E)     \
    arg(K) arg(RENORM) arg(WBF16) arg(RND) arg(IDS) arg(WEIGHTS)
#define REAP_MOE_ARGS(arg) /* reap_moe_step */                                                \
    arg(X2) arg(H) arg(SCRATCH) arg(K) arg(F) arg(D) arg(WBF16) arg(RND) arg(WEIGHTS)        \
    arg(GATE) arg(UP) arg(DOWN) arg(SKIP) arg(NOSUM)
#define REAP_TOKEN_ARGS(arg) /* reap_token_step */                                            \
    arg(LAYERS) arg(ATTN) arg(TABLES) arg(DENSE) arg(F) arg(MOE) arg(TIMES) arg(NORM)        \
    arg(HEAD) arg(V) arg(X) arg(LOGITS) arg(POS) arg(EMB) arg(EMB_BF16)
#define REAP_PREFILL_ARGS(arg) /* reap_moe_prefill */                                         \
    arg(X) arg(Y) arg(IDS) arg(WEIGHTS) arg(TABLE) arg(N) arg(K) arg(E) arg(F) arg(D)        \
    arg(WBF16) arg(RND) arg(FLOATS) arg(INTS) arg(ADD)

#define REAP_A(n) A_##n,
#define REAP_M(n) M_##n,
#define REAP_T(n) T_##n,
#define REAP_P(n) P_##n,
enum { REAP_ATTN_ARGS(REAP_A) A_COUNT };
enum { REAP_MOE_ARGS(REAP_M) M_COUNT };
enum { REAP_TOKEN_ARGS(REAP_T) T_COUNT };
enum { REAP_PREFILL_ARGS(REAP_P) P_COUNT };

/* the layout as compiled, for the loader's check: "ATTN H X2 ... MOE X2 ..." */
#define REAP_ARG_NAME(n) " " #n
#define REAP_ARG_LAYOUT                                                                       \
    "ATTN" REAP_ATTN_ARGS(REAP_ARG_NAME) " MOE" REAP_MOE_ARGS(REAP_ARG_NAME)                  \
    " TOKEN" REAP_TOKEN_ARGS(REAP_ARG_NAME) " PREFILL" REAP_PREFILL_ARGS(REAP_ARG_NAME)

#endif
