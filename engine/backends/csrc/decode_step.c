#include "simd.h"
#include "kernels.h"

/* ---- A whole decode step's layers in one call (batch 1, one position) ----
 * The other files' kernels, in the order engine/model.py's Block runs them, with the same roundings
 * (each op's output is rounded to the model's type, as the eager torch ops round): nothing crosses
 * into Python between layers. */

/* silu(g) = g / (1 + e^-g) over n float32 values, in place allowed: the gate of every decode step's MLP. */
void kv_silu_f32(const float *g, float *y, int64_t n) { silu_f32(g, y, n); }

/* The product for a linear layer's codes: [mode][int8 activations][int4 tiles]. */
typedef void (*kv_product)(const void *, const float *, const float *, const float *, float *, int64_t, int64_t,
                           int64_t, int);
static const kv_product PRODUCTS[KV_INT8 + 1][2][2] = {
    [KV_INT8] = {{(kv_product)kv_matvec_q8, NULL}, {(kv_product)kv_matvec_q8x, NULL}},
    [KV_INT5] = {{(kv_product)kv_matvec_q5, NULL}, {(kv_product)kv_matvec_q5x, NULL}},
    [KV_INT4] = {{(kv_product)kv_matvec_q4, (kv_product)kv_matvec_q4t},
                 {(kv_product)kv_matvec_q4x, (kv_product)kv_matvec_q4tx}},
};

static void quant_matvec(const kv_linear *l, const float *x, float *y, int nt) {
    PRODUCTS[l->mode][l->act != 0][l->tiles != 0](l->w, l->scales, l->mins, x, y, l->out, l->in, l->group, nt);
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
    /* gate_up -> silu(gate) * up -> down over F, h [D] -> t [D] (gu [2F] scratch): a dense MLP, or one expert */ \
    static void mlp_##SUF(const kv_linear *gate_up, const kv_linear *down, int64_t F, const T *h, T *gu, T *t,   \
                          float *fx, float *fy, int nt) {                                                        \
        linear_##SUF(gate_up, h, gu, fx, fy, nt);                                                               \
        for (int64_t i = 0; i < F; i++) fx[i] = TO_F32(gu[i]);                                                  \
        silu_f32(fx, fx, F);                                                                                    \
        for (int64_t i = 0; i < F; i++) /* silu(gate) * up, each rounded as torch rounds */                     \
            gu[i] = FROM_F32(TO_F32(FROM_F32(fx[i])) * TO_F32(gu[F + i]));                                      \
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
        for (int64_t e = 0; e < E; e++) top = fmaxf(top, TO_F32(t[e]));                                         \
        for (int64_t e = 0; e < E; e++) sum += (p[e] = expf(TO_F32(t[e]) - top));                              \
        for (int64_t e = 0; e < E; e++) p[e] /= sum;                                                            \
        float kept = 0.0f;                                                                                      \
        for (int64_t j = 0; j < K; j++) {                                                                       \
            int64_t best = -1;                                                                                  \
            for (int64_t e = 0; e < E; e++)                                                                     \
                if (p[e] >= 0.0f && (best < 0 || p[e] > p[best])) best = e;                                     \
            if (best < 0) best = 0; /* NaN scores: any expert (the load-time check refuses such a step) */   \
            chosen[j] = best, w[j] = p[best], kept += p[best], p[best] = -1.0f;                                 \
        }                                                                                                       \
        for (int64_t j = 0; j < K; j++) w[j] = TO_F32(FROM_F32(L->norm_topk ? w[j] / kept : w[j]));             \
        for (int64_t j = 0; j < K; j++) {                                                                       \
            const kv_linear *ex = L->experts + 2 * chosen[j];                                                   \
            mlp_##SUF(ex, ex + 1, L->expert_f, h, gu, t, fx, fy, nt);                                           \
            for (int64_t i = 0; i < D; i++) {                                                                   \
                T y = FROM_F32(TO_F32(t[i]) * w[j]);                                                            \
                acc[i] = j == 0 ? y : FROM_F32(TO_F32(acc[i]) + TO_F32(y));                                     \
            }                                                                                                   \
        }                                                                                                       \
        for (int64_t i = 0; i < D; i++) x[i] = FROM_F32(TO_F32(x[i]) + TO_F32(acc[i]));                        \
    }                                                                                                           \
    void kv_decode_layers_##SUF(const kv_layer *layers, int64_t n_layers, T *x, const T *cs, const T *sn,   \
                                float eps, float qk_eps, int64_t cap, int64_t pos, int64_t lo, int64_t H,   \
                                int64_t Hkv, int64_t d, int64_t D, int64_t F, T *h, T *qkv, T *att, T *t,   \
                                T *gu, T *acc, float *fx, float *fy, int nt) {                              \
        for (int64_t n = 0; n < n_layers; n++) {                                                            \
            const kv_layer *L = layers + n;                                                                 \
            kv_rmsnorm_##SUF(x, L->attn_norm, h, D, eps);                                                   \
            linear_##SUF(&L->qkv, h, qkv, fx, fy, nt);                                                      \
            kv_attend_##SUF(qkv, cs, sn, L->q_norm, L->k_norm, qk_eps, L->k_cache, L->v_cache, cap, pos, lo, \
                            H, Hkv, d, 1.0f / sqrtf((float)d), att, nt);                                    \
            linear_##SUF(&L->o, att, t, fx, fy, nt);                                                        \
            for (int64_t i = 0; i < D; i++) x[i] = FROM_F32(TO_F32(x[i]) + TO_F32(t[i]));                   \
            kv_rmsnorm_##SUF(x, L->mlp_norm, h, D, eps);                                                    \
            if (L->n_experts) {                                                                             \
                moe_##SUF(L, h, x, gu, t, acc, fx, fy, D, nt);                                              \
                continue;                                                                                   \
            }                                                                                               \
            mlp_##SUF(&L->gate_up, &L->down, F, h, gu, t, fx, fy, nt);                                      \
            for (int64_t i = 0; i < D; i++) x[i] = FROM_F32(TO_F32(x[i]) + TO_F32(t[i]));                   \
        }                                                                                                   \
    }

DECODE(f32, float, f32_id, F32_TO)
DECODE(bf16, uint16_t, bf16_to_f32, BF16_TO)
#ifdef __FLT16_MAX__
DECODE(f16, _Float16, f16_to_f32, F16_TO)
#endif
