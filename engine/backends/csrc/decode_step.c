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
    void kv_decode_layers_##SUF(const kv_layer *layers, int64_t n_layers, T *x, const T *cs, const T *sn,   \
                                float eps, float qk_eps, int64_t cap, int64_t pos, int64_t lo, int64_t H,   \
                                int64_t Hkv, int64_t d, int64_t D, int64_t F, T *h, T *qkv, T *att, T *t,   \
                                T *gu, float *fx, float *fy, int nt) {                                      \
        for (int64_t n = 0; n < n_layers; n++) {                                                            \
            const kv_layer *L = layers + n;                                                                 \
            kv_rmsnorm_##SUF(x, L->attn_norm, h, D, eps);                                                   \
            linear_##SUF(&L->qkv, h, qkv, fx, fy, nt);                                                      \
            kv_attend_##SUF(qkv, cs, sn, L->q_norm, L->k_norm, qk_eps, L->k_cache, L->v_cache, cap, pos, lo, \
                            H, Hkv, d, 1.0f / sqrtf((float)d), att, nt);                                    \
            linear_##SUF(&L->o, att, t, fx, fy, nt);                                                        \
            for (int64_t i = 0; i < D; i++) x[i] = FROM_F32(TO_F32(x[i]) + TO_F32(t[i]));                   \
            kv_rmsnorm_##SUF(x, L->mlp_norm, h, D, eps);                                                    \
            linear_##SUF(&L->gate_up, h, gu, fx, fy, nt);                                                   \
            for (int64_t i = 0; i < F; i++) fx[i] = TO_F32(gu[i]);                                          \
            silu_f32(fx, fx, F);                                                                            \
            for (int64_t i = 0; i < F; i++) /* silu(gate) * up, each rounded as torch rounds */             \
                gu[i] = FROM_F32(TO_F32(FROM_F32(fx[i])) * TO_F32(gu[F + i]));                              \
            linear_##SUF(&L->down, gu, t, fx, fy, nt);                                                      \
            for (int64_t i = 0; i < D; i++) x[i] = FROM_F32(TO_F32(x[i]) + TO_F32(t[i]));                   \
        }                                                                                                   \
    }

DECODE(f32, float, f32_id, F32_TO)
DECODE(bf16, uint16_t, bf16_to_f32, BF16_TO)
#ifdef __FLT16_MAX__
DECODE(f16, _Float16, f16_to_f32, F16_TO)
#endif
