#include "simd.h"
#include "kernels.h"

/* ---- A whole decode step's layers in one call (batch 1, one position) ----
 * The other files' kernels, in the order engine/model.py's Block runs them, with the same roundings
 * (each op's output is rounded to the model's type, as the eager torch ops round): nothing crosses
 * into Python between layers. */

/* silu(g) = g / (1 + e^-g) over n float32 values, in place allowed: the gate of every decode step's MLP. */
void kv_silu_f32(const float *g, float *y, int64_t n) { silu_f32(g, y, n); }

/* y [rows, F] = silu(gate) · up for gu [rows, 2F] (each row gate | up, the gate_up product's layout): a prompt's
 * SwiGLU in one pass a row, where torch took a pass for silu over a strided view and another for the product. */
void kv_silu_mul_rows_f32(const float *gu, float *y, int64_t rows, int64_t F, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gu + r * 2 * F, *u = g + F;
        float *yr = y + r * F;
        silu_f32(g, yr, F);
        for (int64_t i = 0; i < F; i++) yr[i] *= u[i];
    }
}

/* The product for a linear layer's codes: [mode][int8 activations][tiles] (int4's; int8's with int8 activations). */
typedef void (*kv_product)(const void *, const float *, const float *, const float *, float *, int64_t, int64_t,
                           int64_t, int);
static const kv_product PRODUCTS[KV_INT8 + 1][2][2] = {
    [KV_MXFP4] = {{(kv_product)kv_matvec_mx4, NULL}, {(kv_product)kv_matvec_mx4x, NULL}},
    [KV_INT8] = {{(kv_product)kv_matvec_q8, NULL}, {(kv_product)kv_matvec_q8x, (kv_product)kv_matvec_q8tx}},
    [KV_INT5] = {{(kv_product)kv_matvec_q5, NULL}, {(kv_product)kv_matvec_q5x, NULL}},
    [KV_INT4] = {{(kv_product)kv_matvec_q4, (kv_product)kv_matvec_q4t},
                 {(kv_product)kv_matvec_q4x, (kv_product)kv_matvec_q4tx}},
};

static void quant_matvec(const kv_linear *l, const float *x, float *y, int nt) {
    PRODUCTS[l->mode][l->act != 0][l->tiles != 0](l->w, l->scales, l->mins, x, y, l->out, l->in, l->group, nt);
}

/* The first position layer L attends to at `pos`: the step's `lo`, or later within the layer's own window. */
static int64_t layer_lo(const kv_layer *L, int64_t pos, int64_t lo) {
    int64_t w = L->window ? pos - L->window + 1 : 0;
    return w > lo ? w : lo;
}

#define DECODE(SUF, T, TO_F32, FROM_F32)                                                                   \
    static void linear_##SUF(const kv_linear *l, const T *x, T *y, float *fx, float *fy, int nt) {          \
        if (l->mode == KV_FLOAT) {                                                                          \
            kv_matvec_##SUF((const void *)l->w, (const void *)x, (void *)y, l->out, l->in, nt);            \
        } else {                                                                                            \
            for (int64_t i = 0; i < l->in; i++) fx[i] = TO_F32(x[i]);                                       \
            quant_matvec(l, fx, fy, nt);                                                                    \
            for (int64_t i = 0; i < l->out; i++) y[i] = FROM_F32(fy[i]);                                    \
        }                                                                                                   \
        if (l->bias) {                                                                                      \
            const T *b = l->bias;                                                                           \
            for (int64_t i = 0; i < l->out; i++) y[i] = FROM_F32(TO_F32(y[i]) + TO_F32(b[i]));              \
        }                                                                                                   \
    }                                                                                                       \
    /* gate_up -> silu(gate) * up -> down over F, h [D] -> t [D] (gu [2F] scratch): a dense MLP, or one expert; \
     * with a limit (gpt-oss's experts) the clamped SwiGLU (clamp(up, ±l) + 1) · g·σ(α g), g = min(gate, l) */    \
    static void mlp_##SUF(const kv_linear *gate_up, const kv_linear *down, int64_t F, float limit, float alpha,  \
                          const T *h, T *gu, T *t, float *fx, float *fy, int nt) {                               \
        linear_##SUF(gate_up, h, gu, fx, fy, nt);                                                               \
        if (limit > 0.0f) {                                                                                     \
            for (int64_t i = 0; i < F; i++) { /* each op rounded as engine/feedforward.py's torch ops round */   \
                float g = fminf(TO_F32(gu[i]), limit), u = fmaxf(fminf(TO_F32(gu[F + i]), limit), -limit);      \
                float sg = TO_F32(FROM_F32(1.0f / (1.0f + expf(-TO_F32(FROM_F32(g * alpha))))));               \
                float glu = TO_F32(FROM_F32(g * sg));                                                           \
                gu[i] = FROM_F32(TO_F32(FROM_F32(u + 1.0f)) * glu);                                             \
            }                                                                                                   \
        } else {                                                                                                \
            for (int64_t i = 0; i < F; i++) fx[i] = TO_F32(gu[i]);                                              \
            silu_f32(fx, fx, F);                                                                                \
            for (int64_t i = 0; i < F; i++) /* silu(gate) * up, each rounded as torch rounds */                 \
                gu[i] = FROM_F32(TO_F32(FROM_F32(fx[i])) * TO_F32(gu[F + i]));                                  \
        }                                                                                                       \
        linear_##SUF(down, gu, t, fx, fy, nt);                                                                  \
    }                                                                                                           \
    /* A mixture's MLP on h [D], added into x: the router's softmax (float32), its top k (highest first, the   \
     * lower index on a tie), their weights renormalised where the layer says and rounded to T, each chosen     \
     * expert's output times its weight summed into acc [D] as engine/model.py's MoE sums them. */             \
    static void moe_##SUF(const kv_layer *L, const T *h, T *x, T *gu, T *t, T *acc, float *fx, float *fy,      \
                          int64_t D, int nt) {                                                                   \
        const int64_t E = L->n_experts, K = L->top_k;                                                           \
        float p[KV_MAX_EXPERTS], w[KV_MAX_TOP_K], top = -INFINITY, sum = 0.0f;                                  \
        int64_t chosen[KV_MAX_TOP_K];                                                                            \
        linear_##SUF(&L->router, h, t, fx, fy, nt); /* logits [E], rounded to T as the router's output is */    \
        if (L->topk_first) /* gpt-oss: the logits themselves chosen from, their softmax over the k after */     \
            for (int64_t e = 0; e < E; e++) p[e] = TO_F32(t[e]);                                                \
        else {                                                                                                  \
            for (int64_t e = 0; e < E; e++) top = fmaxf(top, TO_F32(t[e]));                                     \
            for (int64_t e = 0; e < E; e++) sum += (p[e] = expf(TO_F32(t[e]) - top));                          \
            for (int64_t e = 0; e < E; e++) p[e] /= sum;                                                        \
        }                                                                                                       \
        float kept = 0.0f;                                                                                      \
        for (int64_t j = 0; j < K; j++) { /* taken ones marked NaN: never above another again */             \
            int64_t best = L->route ? L->route[j] : -1; /* a choice given (the load-time check's) */            \
            for (int64_t e = 0; e < E && !L->route; e++)                                                        \
                if (p[e] == p[e] && (best < 0 || p[e] > p[best])) best = e;                                     \
            if (best < 0 || best >= E) best = 0; /* NaN scores: any expert (the check refuses such a step) */ \
            chosen[j] = best, w[j] = p[best], kept += p[best], p[best] = NAN;                                   \
        }                                                                                                       \
        if (L->topk_first) { /* the k logits' softmax, rounded to T as torch's softmax in T rounds it */        \
            float m = w[0], z = 0.0f;                                                                           \
            for (int64_t j = 0; j < K; j++) z += (w[j] = expf(w[j] - m));                                       \
            for (int64_t j = 0; j < K; j++) w[j] = TO_F32(FROM_F32(w[j] / z));                                  \
        } else                                                                                                  \
            for (int64_t j = 0; j < K; j++) w[j] = TO_F32(FROM_F32(L->norm_topk ? w[j] / kept : w[j]));         \
        for (int64_t j = 0; j < K; j++) {                                                                       \
            const kv_linear *ex = L->experts + 2 * chosen[j];                                                   \
            mlp_##SUF(ex, ex + 1, L->expert_f, L->swiglu_limit, L->swiglu_alpha, h, gu, t, fx, fy, nt);         \
            for (int64_t i = 0; i < D; i++) {                                                                   \
                T y = FROM_F32(TO_F32(t[i]) * w[j]);                                                            \
                acc[i] = j == 0 ? y : FROM_F32(TO_F32(acc[i]) + TO_F32(y));                                     \
            }                                                                                                   \
        }                                                                                                       \
        for (int64_t i = 0; i < D; i++) x[i] = FROM_F32(TO_F32(x[i]) + TO_F32(acc[i]));                        \
    }                                                                                                           \
    void kv_decode_layers_##SUF(const kv_layer *layers, int64_t n_layers, T *x, const T *cs, const T *sn,   \
                                float eps, float qk_eps, int64_t cap, int64_t pos, int64_t lo,              \
                                const int32_t *tb, int64_t H, int64_t Hkv, int64_t d, int64_t D, int64_t F, \
                                T *h, T *qkv, T *att, T *t, T *gu, T *acc, float *fx, float *fy, int nt) {  \
        for (int64_t n = 0; n < n_layers; n++) {                                                            \
            const kv_layer *L = layers + n;                                                                 \
            kv_rmsnorm_##SUF(x, L->attn_norm, h, D, eps);                                                   \
            linear_##SUF(&L->qkv, h, qkv, fx, fy, nt);                                                      \
            kv_attend_##SUF(qkv, cs, sn, L->q_norm, L->k_norm, qk_eps, L->k_cache, L->v_cache, cap, pos,    \
                            layer_lo(L, pos, lo), tb, H, Hkv, d, 1.0f / sqrtf((float)d), L->sinks, att, nt); \
            linear_##SUF(&L->o, att, t, fx, fy, nt);                                                        \
            for (int64_t i = 0; i < D; i++) x[i] = FROM_F32(TO_F32(x[i]) + TO_F32(t[i]));                   \
            kv_rmsnorm_##SUF(x, L->mlp_norm, h, D, eps);                                                    \
            if (L->n_experts) {                                                                             \
                moe_##SUF(L, h, x, gu, t, acc, fx, fy, D, nt);                                              \
                continue;                                                                                   \
            }                                                                                               \
            mlp_##SUF(&L->gate_up, &L->down, F, 0.0f, 1.0f, h, gu, t, fx, fy, nt);                          \
            for (int64_t i = 0; i < D; i++) x[i] = FROM_F32(TO_F32(x[i]) + TO_F32(t[i]));                   \
        }                                                                                                   \
    }

/* ---- Several sequences' decode steps in one call (continuous batching) ----
 * Every product reads its weights a chunk of rows at a time for all B rows (from the thread's cache after the
 * first), each row through the same one-row product as a sequence alone: a row's values never depend on the
 * other rows, so a request's tokens never depend on what runs beside it. */
/* A row of codes' bytes and its scales' count (a linear layer of codes: not KV_FLOAT). */
static int64_t code_bytes(const kv_linear *l) {
    if (l->mode == KV_INT8) return l->in;
    return l->mode == KV_INT4 || l->mode == KV_MXFP4 ? l->in / 2 : l->in / Q5_GROUP * Q5_BYTES;
}
static int64_t row_groups(const kv_linear *l) {
    return l->in / (l->mode == KV_INT5 ? Q5_GROUP : l->mode == KV_MXFP4 ? MX_GROUP : l->group);
}
static int64_t scale_bytes(const kv_linear *l) { return l->mode == KV_MXFP4 ? 1 : 4; } /* e8m0 bytes, or float32 */

/* The bytes of one weight row with its scales (and offsets). */
static int64_t row_bytes(const kv_linear *l, int64_t elem) {
    if (l->mode == KV_FLOAT) return l->in * elem;
    return code_bytes(l) + row_groups(l) * scale_bytes(l) * (l->mins ? 2 : 1);
}

/* Rows per chunk: what nt threads' shares of KV_CHUNK_BYTES hold, whole tiles (16 rows where not tiled). */
static int64_t chunk_rows(const kv_linear *l, int64_t elem, int nt) {
    int64_t unit = l->tiles ? l->tiles : 16;
    int64_t r = (int64_t)KV_CHUNK_BYTES * (nt > 0 ? nt : 1) / row_bytes(l, elem) / unit * unit;
    if (r < unit) r = unit;
    return r >= l->out ? l->out : r;
}

/* Rows o0..o0+n-1 of a linear layer, as a layer of its own (rows and tiles of 16 lie in order). */
static kv_linear rows_of(const kv_linear *l, int64_t o0, int64_t n, int64_t elem) {
    kv_linear s = *l;
    s.out = n;
    if (l->mode == KV_FLOAT) {
        s.w = (const char *)l->w + o0 * l->in * elem;
    } else {
        s.w = (const uint8_t *)l->w + o0 * code_bytes(l);
        s.scales = (const float *)((const uint8_t *)l->scales + o0 * row_groups(l) * scale_bytes(l));
        s.mins = l->mins ? l->mins + o0 * row_groups(l) : NULL;
    }
    s.bias = l->bias ? (const void *)((const char *)l->bias + o0 * elem) : NULL;
    return s;
}

/* float weights' products of B rows at once, each weight's load shared among them: every row's outputs its one-row
 * product's (linear_), rounded and the bias added as linear_ adds it, bit for bit; 1 when done (fx, fy: B rows) */
static int float_rows_f32(const kv_linear *l, int64_t B, const float *x, int64_t xs, float *y, int64_t ys, float *fx,
                          float *fy, int nt) {
    (void)fx, (void)fy;
    kv_matvec_f32_rows((const float *)l->w, x, xs, y, ys, l->out, l->in, B, nt);
    if (l->bias)
        for (int64_t b = 0; b < B; b++)
            for (int64_t i = 0; i < l->out; i++) y[b * ys + i] = y[b * ys + i] + ((const float *)l->bias)[i];
    return 1;
}
/* B rows of x (xs apart) widened to float32 into fx [B, in]; the products' fy [B, out] rounded into y (ys apart) and
 * the bias added, as linear_ does for one row: what every product of several rows on float32 buffers is wrapped in */
#define WIDE_ROWS(SUF, T, TO_F32, FROM_F32)                                                                       \
    static void widen_rows_##SUF(const kv_linear *l, int64_t B, const T *x, int64_t xs, float *fx) {             \
        for (int64_t b = 0; b < B; b++)                                                                           \
            for (int64_t i = 0; i < l->in; i++) fx[b * l->in + i] = TO_F32(x[b * xs + i]);                       \
    }                                                                                                             \
    static void narrow_rows_##SUF(const kv_linear *l, int64_t B, const float *fy, T *y, int64_t ys) {            \
        for (int64_t b = 0; b < B; b++) {                                                                         \
            T *yb = y + b * ys;                                                                                   \
            for (int64_t i = 0; i < l->out; i++) yb[i] = FROM_F32(fy[b * l->out + i]);                            \
            if (l->bias)                                                                                          \
                for (int64_t i = 0; i < l->out; i++) yb[i] = FROM_F32(TO_F32(yb[i]) + TO_F32(((const T *)l->bias)[i])); \
        }                                                                                                         \
    }
WIDE_ROWS(f32, float, f32_id, F32_TO)
WIDE_ROWS(bf16, uint16_t, bf16_to_f32, BF16_TO)
#ifdef __FLT16_MAX__
WIDE_ROWS(f16, _Float16, f16_to_f32, F16_TO)
#endif
#define FLOAT_ROWS_HALF(SUF, T, PRODUCT)                                                                          \
    static int float_rows_##SUF(const kv_linear *l, int64_t B, const T *x, int64_t xs, T *y, int64_t ys,          \
                                float *fx, float *fy, int nt) {                                                   \
        widen_rows_##SUF(l, B, x, xs, fx);                                                                        \
        PRODUCT;                                                                                                  \
        narrow_rows_##SUF(l, B, fy, y, ys);                                                                       \
        return 1;                                                                                                 \
    }
FLOAT_ROWS_HALF(bf16, uint16_t, kv_matvec_bf16_rows((const uint16_t *)l->w, x, xs, fx, fy, l->out, l->in, B, nt))
#ifdef __FLT16_MAX__
FLOAT_ROWS_HALF(f16, _Float16, kv_matvec_f16_rows((const _Float16 *)l->w, fx, fy, l->out, l->in, B, nt))
#endif

/* The products of several rows that share each weight's load among them */
typedef void (*kv_rows_product)(const void *, const float *, const float *, const float *, float *, int64_t, int64_t,
                                int64_t, int64_t, int);
#define ROWS_Q8 ((kv_rows_product)kv_matvec_q8_rows)
#define ROWS_Q4T ((kv_rows_product)kv_matvec_q4t_rows)
#define ROWS_Q8X ((kv_rows_product)kv_matvec_q8x_rows)
#define ROWS_Q4TX ((kv_rows_product)kv_matvec_q4tx_rows)
#define ROWS_Q8TX ((kv_rows_product)kv_matvec_q8tx_rows)

#define DECODE_BATCH(SUF, T, TO_F32, FROM_F32)                                                                  \
    /* y [B, out] (rows ys apart) = W x for x [B, in] (rows xs apart), a chunk of W's rows for all B at a time */ \
    static void rows_##SUF(const kv_linear *l, int64_t B, const T *x, int64_t xs, T *y, int64_t ys, float *fx,    \
                           float *fy, int nt) {                                                                   \
        if (B > 1 && l->mode == KV_FLOAT && float_rows_##SUF(l, B, x, xs, y, ys, fx, fy, nt)) return;            \
        const int tiled = l->mode == KV_INT4 && l->tiles, q8 = l->mode == KV_INT8;                               \
        if (B > 1 && (tiled || q8)) { /* products that take the B rows at once */                               \
            widen_rows_##SUF(l, B, x, xs, fx);                                                                    \
            (l->act ? (tiled ? ROWS_Q4TX : l->tiles ? ROWS_Q8TX : ROWS_Q8X) : (tiled ? ROWS_Q4T : ROWS_Q8))(       \
                l->w, l->scales, l->mins, fx, fy, l->out, l->in, l->group, B, nt);                                \
            narrow_rows_##SUF(l, B, fy, y, ys);                                                                   \
            return;                                                                                               \
        }                                                                                                         \
        const int64_t R = chunk_rows(l, (int64_t)sizeof(T), nt);                                                 \
        for (int64_t o0 = 0; o0 < l->out; o0 += R) {                                                              \
            kv_linear sub = rows_of(l, o0, R < l->out - o0 ? R : l->out - o0, (int64_t)sizeof(T));               \
            for (int64_t b = 0; b < B; b++) linear_##SUF(&sub, x + b * xs, y + b * ys + o0, fx, fy, nt);        \
        }                                                                                                         \
    }                                                                                                             \
    void kv_linear_rows_##SUF(const kv_linear *l, int64_t B, const T *x, T *y, float *fx, float *fy, int nt) {    \
        rows_##SUF(l, B, x, l->in, y, l->out, fx, fy, nt);                                                       \
    }                                                                                                             \
    void kv_decode_batch_##SUF(const kv_layer *layers, int64_t n_layers, int64_t B, T *x, const T *cs, const T *sn, \
                               float eps, float qk_eps, int64_t cap, const int64_t *pos, const int64_t *lo,       \
                               const int32_t *const *tb, void *const *kc, void *const *vc, int64_t H,             \
                               int64_t Hkv, int64_t d, int64_t D, int64_t F, int64_t ts, int64_t gs, T *h, T *qkv, \
                               T *att, T *t, T *gu, T *acc, float *fx, float *fy, int nt) {                       \
        const int64_t W = (H + 2 * Hkv) * d, A = H * d;                                                         \
        for (int64_t n = 0; n < n_layers; n++) {                                                                \
            const kv_layer *L = layers + n;                                                                     \
            for (int64_t b = 0; b < B; b++) kv_rmsnorm_##SUF(x + b * D, L->attn_norm, h + b * D, D, eps);       \
            rows_##SUF(&L->qkv, B, h, D, qkv, W, fx, fy, nt);                                                   \
            for (int64_t b = 0; b < B; b++)                                                                     \
                kv_attend_##SUF(qkv + b * W, cs + b * d, sn + b * d, L->q_norm, L->k_norm, qk_eps,              \
                                kc[b * n_layers + n], vc[b * n_layers + n], cap, pos[b], layer_lo(L, pos[b], lo[b]), \
                                tb[b], H, Hkv, d, 1.0f / sqrtf((float)d), L->sinks, att + b * A, nt);           \
            rows_##SUF(&L->o, B, att, A, t, ts, fx, fy, nt);                                                    \
            for (int64_t b = 0; b < B; b++)                                                                     \
                for (int64_t i = 0; i < D; i++) x[b * D + i] = FROM_F32(TO_F32(x[b * D + i]) + TO_F32(t[b * ts + i])); \
            for (int64_t b = 0; b < B; b++) kv_rmsnorm_##SUF(x + b * D, L->mlp_norm, h + b * D, D, eps);        \
            if (L->n_experts) { /* each row its own experts */                                                 \
                for (int64_t b = 0; b < B; b++)                                                                 \
                    moe_##SUF(L, h + b * D, x + b * D, gu + b * gs, t + b * ts, acc + b * D, fx, fy, D, nt);    \
                continue;                                                                                       \
            }                                                                                                   \
            rows_##SUF(&L->gate_up, B, h, D, gu, gs, fx, fy, nt);                                               \
            for (int64_t b = 0; b < B; b++) { /* silu(gate) * up, rounded as mlp_ rounds it */                 \
                T *g = gu + b * gs;                                                                             \
                for (int64_t i = 0; i < F; i++) fx[i] = TO_F32(g[i]);                                           \
                silu_f32(fx, fx, F);                                                                            \
                for (int64_t i = 0; i < F; i++) g[i] = FROM_F32(TO_F32(FROM_F32(fx[i])) * TO_F32(g[F + i]));    \
            }                                                                                                   \
            rows_##SUF(&L->down, B, gu, gs, t, ts, fx, fy, nt);                                                 \
            for (int64_t b = 0; b < B; b++)                                                                     \
                for (int64_t i = 0; i < D; i++) x[b * D + i] = FROM_F32(TO_F32(x[b * D + i]) + TO_F32(t[b * ts + i])); \
        }                                                                                                       \
    }

DECODE(f32, float, f32_id, F32_TO)
DECODE_BATCH(f32, float, f32_id, F32_TO)
DECODE(bf16, uint16_t, bf16_to_f32, BF16_TO)
DECODE_BATCH(bf16, uint16_t, bf16_to_f32, BF16_TO)
#ifdef __FLT16_MAX__
DECODE(f16, _Float16, f16_to_f32, F16_TO)
DECODE_BATCH(f16, _Float16, f16_to_f32, F16_TO)
#endif
