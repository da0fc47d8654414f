#include "integer_codes.h"
#include <stdlib.h>
/* ---- Several rows of x at once against int8 codes in rows, with int8 activations (continuous batching) ----
 * Each row of x is quantized as the one-row product quantizes it, and each weight step's codes are loaded once for
 * up to 4 rows of x and 2 weight rows, each row's lanes then taking exactly the one-row product's instructions in
 * its order: a row's result is its one-row product's, bit for bit, whatever rows run beside it. Codes in tiles (an
 * int4 model's layers, int8 ones under int8 activations): integer_tiles.c. */
#if XQ_STEP == 64
/* int8 codes, NW weight rows (r, so: NW rows apart by in and groups) against NR rows of x: each x row's codes,
 * starts and scales loaded once a step for the NW weight rows, and each (weight row, x row) lane sum taking exactly
 * INT_ROW(int_row_q8)'s instructions in its order. Output (w, k) at yk[k · ys + w]. */
static inline __attribute__((always_inline)) void q8x_rows(const int8_t *r, const float *so, int64_t in, int64_t g,
                                                           int64_t groups, int NW, int NR, const int8_t *c,
                                                           const int32_t *neg, const float *d, int64_t cs, float *yk,
                                                           int64_t ys) {
    __m512 acc[2][4], acc1[2][4];
    for (int w = 0; w < NW; w++)
        for (int k = 0; k < NR; k++) acc[w][k] = acc1[w][k] = _mm512_setzero_ps();
    /* one step's lanes for every (w, k): A[w][k] += cvt(dpbusd(neg_k, u_w, c_k)) * SCALE(w, k) */
#define STEP_WK(A, i, SCALE)                                                                                     \
    for (int k = 0; k < NR; k++) {                                                                               \
        __m512i nk_ = _mm512_loadu_si512(neg + k * cs + (i) / 4), ck_ = _mm512_loadu_si512(c + k * 4 * cs + (i)); \
        __m512 dk_ = _mm512_loadu_ps(d + k * cs + (i) / 4);                                                      \
        for (int w = 0; w < NW; w++)                                                                             \
            A[w][k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(nk_, u[w], ck_)), SCALE, A[w][k]);  \
    }
    vu u[2];
    if (g % 64 == 0) {
        for (int64_t j = 0; j < in / g; j++) {
            __m512 p0[2][4], p1[2][4];
            for (int w = 0; w < NW; w++)
                for (int k = 0; k < NR; k++) p0[w][k] = p1[w][k] = _mm512_setzero_ps();
            int64_t i = j * g, end = i + g;
            for (; i + 128 <= end; i += 128) {
                for (int w = 0; w < NW; w++) u[w] = u_q8(r + w * in, i, in);
                STEP_WK(p0, i, dk_)
                for (int w = 0; w < NW; w++) u[w] = u_q8(r + w * in, i + 64, in);
                STEP_WK(p1, i + 64, dk_)
            }
            if (i < end) {
                for (int w = 0; w < NW; w++) u[w] = u_q8(r + w * in, i, in);
                STEP_WK(p0, i, dk_)
            }
            for (int w = 0; w < NW; w++) {
                __m512 sj = _mm512_set1_ps(so[w * groups + j]);
                for (int k = 0; k < NR; k++) acc[w][k] = _mm512_fmadd_ps(sj, _mm512_add_ps(p0[w][k], p1[w][k]), acc[w][k]);
            }
        }
    } else {
        __m512 sp[2];
        int64_t i = 0;
        for (; i + 128 <= in; i += 128) {
            for (int w = 0; w < NW; w++) u[w] = u_q8(r + w * in, i, in), sp[w] = scale_pair(so + w * groups, i, in, g, ORDER_PLAIN);
            STEP_WK(acc, i, _mm512_mul_ps(dk_, sp[w]))
            for (int w = 0; w < NW; w++)
                u[w] = u_q8(r + w * in, i + 64, in), sp[w] = scale_pair(so + w * groups, i + 64, in, g, ORDER_PLAIN);
            STEP_WK(acc1, i + 64, _mm512_mul_ps(dk_, sp[w]))
        }
        for (; i < in; i += 64) {
            for (int w = 0; w < NW; w++) u[w] = u_q8(r + w * in, i, in), sp[w] = scale_pair(so + w * groups, i, in, g, ORDER_PLAIN);
            STEP_WK(acc, i, _mm512_mul_ps(dk_, sp[w]))
        }
        for (int w = 0; w < NW; w++)
            for (int k = 0; k < NR; k++) acc[w][k] = _mm512_add_ps(acc[w][k], acc1[w][k]);
    }
#undef STEP_WK
    for (int w = 0; w < NW; w++)
        for (int k = 0; k < NR; k++) yk[k * ys + w] = _mm512_reduce_add_ps(acc[w][k]);
}

static int int_matvec_q8_rows(const int8_t *q, const float *s, const float *m, const float *x, float *y,
                              int64_t out, int64_t in, int64_t g, int64_t B, int nt) {
    const int64_t np = XQ_NP(in), groups = in / g, cs = np / 4;
    int8_t *c = malloc((size_t)(B * np));
    int32_t *neg = malloc(sizeof(int32_t) * (size_t)(B * cs));
    float *f = malloc(sizeof(float) * (size_t)(B * (cs + groups)));
    if (!c || !neg || !f) {
        free(c), free(neg), free(f);
        return 0;
    }
    float *d = f, *xs = f + B * cs;
    for (int64_t k = 0; k < B; k++) {
        quantize_x(x + k * in, in, BIAS8, ORDER_PLAIN, c + k * np, neg + k * cs, d + k * cs);
        if (m) group_sums(x + k * in, xs + k * groups, groups, g);
    }
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t o = 0; o < out; o += 2) { /* two weight rows a pass: each x row's data loaded once for both */
        const int8_t *r = q + o * in;
        const float *so = s + o * groups;
        const int two = o + 1 < out;
        for (int64_t k0 = 0; k0 < B; k0 += 4) { /* four x rows a pass: two accumulators each, what registers hold */
            const int8_t *ck = c + k0 * np;
            const int32_t *nk = neg + k0 * cs;
            const float *dk = d + k0 * cs;
            float *yk = y + k0 * out + o;
#define Q8X(NW, NR) q8x_rows(r, so, in, g, groups, NW, NR, ck, nk, dk, cs, yk, out)
            switch ((B - k0 < 4 ? B - k0 : 4) + 4 * two) {
            case 1: Q8X(1, 1); break;
            case 2: Q8X(1, 2); break;
            case 3: Q8X(1, 3); break;
            case 4: Q8X(1, 4); break;
            case 5: Q8X(2, 1); break;
            case 6: Q8X(2, 2); break;
            case 7: Q8X(2, 3); break;
            default: Q8X(2, 4);
            }
#undef Q8X
            if (m)
                for (int64_t w = o; w <= o + two; w++)
                    for (int64_t k = k0; k < B && k < k0 + 4; k++)
                        y[k * out + w] += dot_f32(m + w * groups, xs + k * groups, groups);
        }
    }
    free(c), free(neg), free(f);
    return 1;
}
#endif

/* The exported product of B rows of int8 codes with int8 activations: each row its kv_matvec_q8x product. */
void kv_matvec_q8x_rows(const int8_t *q, const float *s, const float *m, const float *x, float *y, int64_t out,
                        int64_t in, int64_t g, int64_t B, int nt) {
#if XQ_STEP == 64
    if (int_products_fit(in, g) && int_matvec_q8_rows(q, s, m, x, y, out, in, g, B, nt)) return;
#endif
    for (int64_t k = 0; k < B; k++) kv_matvec_q8x(q, s, m, x + k * in, y + k * out, out, in, g, nt);
}
