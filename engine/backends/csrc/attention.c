/* The rest of a decode step for one position (B = 1): RMSNorm, the rotation of q and k (with Qwen3's q/k
 * norms), the cache write and attention. */
#include "simd.h"
#include "kernels.h"

/* ---- The rest of a decode step: RMSNorm and attention for one position (B = 1) ----
 * Each exists for float32, bfloat16 and float16 storage, computes in float32 and rounds where torch's
 * eager code rounds (after the norm, after the rotation), so decode matches prefill's torch path. */
/* y = w * (x / rms(x)): float32 as F.rms_norm; 16-bit types as transformers: normalise in float32,
 * round, then scale. */
#define RMSNORM(NAME, T, TO_F32, FROM_F32, ROUND)                                                  \
    void NAME(const T *x, const T *w, T *y, int64_t n, float eps) {                                 \
        double ss = 0; /* the squares summed in double: a float32 running sum drifts ~n ulps from torch's */ \
        for (int64_t i = 0; i < n; i++) ss += (double)TO_F32(x[i]) * TO_F32(x[i]);                  \
        float r = 1.0f / sqrtf((float)(ss / (double)n) + eps);                                      \
        for (int64_t i = 0; i < n; i++) y[i] = FROM_F32(TO_F32(w[i]) * ROUND(TO_F32(x[i]) * r));    \
    }

/* The rotation of one head in place, [x1 | x2] -> x·cos + [x2 | x1]·sin_signed, after its optional
 * RMSNorm (Qwen3's q/k norms; nw = NULL without). Computed in float32, rounded to T. */
#define ROTATE(NAME, T, TO_F32, FROM_F32, ROUND)                                                   \
    static void NAME(const T *x, const T *nw, float eps, const T *cs, const T *sn, float *out, int64_t d) { \
        float v[d];                                                                                 \
        for (int64_t i = 0; i < d; i++) v[i] = TO_F32(x[i]);                                        \
        if (nw) {                                                                                   \
            float ss = 0;                                                                           \
            for (int64_t i = 0; i < d; i++) ss += v[i] * v[i];                                      \
            float r = 1.0f / sqrtf(ss / (float)d + eps);                                            \
            for (int64_t i = 0; i < d; i++) v[i] = ROUND(TO_F32(nw[i]) * ROUND(v[i] * r));          \
        }                                                                                           \
        int64_t h = d / 2;                                                                          \
        for (int64_t i = 0; i < d; i++) {                                                           \
            float sw = i < h ? v[i + h] : v[i - h];                                                 \
            out[i] = ROUND(ROUND(v[i] * TO_F32(cs[i])) + ROUND(sw * TO_F32(sn[i])));                \
        }                                                                                           \
    }

#define ATTEND_CHUNK 64 /* keys scored at a time, then exponentiated together, then summed into the output */

/* Attention of the new position `pos`: q, k, v come packed in one row qkv [(H + 2 Hkv) d]; k (rotated)
 * and v are stored into the layer's cache kc, vc [Hkv, cap, d]; each query head attends to keys lo..pos
 * of its group's KV head with a one-pass (online) softmax (with `sinks` [H], each head's logit joins the
 * denominator as a key whose value is 0: gpt-oss's sinks; NULL: none); y [H d]. Position j lies in slot KV_SLOT(tb, j):
 * j itself in a cache of its own (tb NULL), else in block tb[j / KV_BLOCK] of a pool shared by many. */
#define ATTEND(NAME, ROT, DOT, AXPY, T, TO_F32, FROM_F32, ROUND)                                              \
    void NAME(const T *qkv, const T *cs, const T *sn, const T *qn, const T *kn, float eps, T *kc, T *vc, \
              int64_t cap, int64_t pos, int64_t lo, const int32_t *tb, int64_t H, int64_t Hkv, int64_t d,  \
              float scale, const float *sinks, T *y, int nt) {                                            \
        for (int64_t h = 0; h < Hkv; h++) {                                                         \
            float k[d];                                                                             \
            ROT(qkv + (H + h) * d, kn, eps, cs, sn, k, d);                                          \
            T *kd = kc + (h * cap + KV_SLOT(tb, pos)) * d, *vd = vc + (h * cap + KV_SLOT(tb, pos)) * d; \
            const T *v = qkv + (H + Hkv + h) * d;                                                   \
            for (int64_t i = 0; i < d; i++) { kd[i] = FROM_F32(k[i]); vd[i] = v[i]; }               \
        }                                                                                           \
        int64_t G = H / Hkv;                                                                        \
        _Pragma("omp parallel for num_threads(nt) schedule(static)")                                \
        for (int64_t h = 0; h < H; h++) {                                                           \
            float q[d], acc[d], s[ATTEND_CHUNK];                                                    \
            ROT(qkv + h * d, qn, eps, cs, sn, q, d);                                                \
            const T *K = kc + (h / G) * cap * d, *V = vc + (h / G) * cap * d;                       \
            float m = sinks ? sinks[h] : -INFINITY, l = sinks ? 1.0f : 0.0f; /* a sink: a key of value 0 */ \
            for (int64_t i = 0; i < d; i++) acc[i] = 0;                                             \
            for (int64_t j0 = lo; j0 <= pos; j0 += ATTEND_CHUNK) {                                  \
                int64_t n = pos + 1 - j0 < ATTEND_CHUNK ? pos + 1 - j0 : ATTEND_CHUNK;              \
                float mc = -INFINITY;                                                               \
                for (int64_t j = 0; j < n; j++) { /* scores: independent dot products */            \
                    s[j] = DOT(K + KV_SLOT(tb, j0 + j) * d, q, d) * scale;                          \
                    mc = s[j] > mc ? s[j] : mc;                                                     \
                }                                                                                   \
                if (mc > m) { /* a new maximum: rescale what was summed so far */                   \
                    float c = expf(m - mc);                                                         \
                    l *= c;                                                                         \
                    for (int64_t i = 0; i < d; i++) acc[i] *= c;                                    \
                    m = mc;                                                                         \
                }                                                                                   \
                exp_shifted(s, s, n, m);                                                            \
                for (int64_t j = 0; j < n; j++) {                                                   \
                    l += s[j];                                                                      \
                    AXPY(acc, 1.0f, s[j], V + KV_SLOT(tb, j0 + j) * d, d);                          \
                }                                                                                   \
            }                                                                                       \
            for (int64_t i = 0; i < d; i++) y[h * d + i] = FROM_F32(acc[i] / l);                    \
        }                                                                                           \
    }
RMSNORM(kv_rmsnorm_f32, float, f32_id, F32_TO, f32_id)
RMSNORM(kv_rmsnorm_bf16, uint16_t, bf16_to_f32, BF16_TO, round_bf16)
/* `rows` rows of n (a prompt's positions, contiguous), each as the one-row norm computes it, rows over threads:
 * a prompt's norms were six of torch's passes over the rows (square, mean, add, rsqrt, two products) */
#define RMSNORM_ROWS(NAME, ONE, T)                                                                  \
    void NAME(const T *x, const T *w, T *y, int64_t rows, int64_t n, float eps, int nt) {          \
        _Pragma("omp parallel for num_threads(nt) schedule(static)") for (int64_t r = 0; r < rows; r++) \
            ONE(x + r * n, w, y + r * n, n, eps);                                                   \
    }
RMSNORM_ROWS(kv_rmsnorm_rows_f32, kv_rmsnorm_f32, float)
RMSNORM_ROWS(kv_rmsnorm_rows_bf16, kv_rmsnorm_bf16, uint16_t)
ROTATE(rotate_f32, float, f32_id, F32_TO, f32_id)
ROTATE(rotate_bf16, uint16_t, bf16_to_f32, BF16_TO, round_bf16)
ATTEND(kv_attend_f32, rotate_f32, dot_f32, axpy_f32, float, f32_id, F32_TO, f32_id)
ATTEND(kv_attend_bf16, rotate_bf16, dot_bf16, axpy_bf16, uint16_t, bf16_to_f32, BF16_TO, round_bf16)
#ifdef __FLT16_MAX__
RMSNORM(kv_rmsnorm_f16, _Float16, f16_to_f32, F16_TO, round_f16)
RMSNORM_ROWS(kv_rmsnorm_rows_f16, kv_rmsnorm_f16, _Float16)
ROTATE(rotate_f16, _Float16, f16_to_f32, F16_TO, round_f16)
ATTEND(kv_attend_f16, rotate_f16, dot_f16, axpy_f16, _Float16, f16_to_f32, F16_TO, round_f16)
#endif
