#include "integer_codes.h"
#include <stdlib.h>
/* ---- Several rows of x at once with int8 activations (continuous batching's decode steps) ----
 * Each row of x is quantized as the one-row product quantizes it, and each weight step's codes are loaded and
 * unpacked once for up to ROWS_A_PASS rows, each row's lanes then taking exactly the one-row product's
 * instructions in its order: a row's result is its one-row product's, bit for bit, whatever rows run beside it. */
#define ROWS_A_PASS 8
#if INT_TILES
/* Tiles of 16 rows against NR rows of x: the quantized codes c [NR][np/4] (4 a lane), and per row and block of 32
 * its -8 · (codes' sum) and scale; per row its group sums xs (with offsets). y's row k at yk + k · ys. */
static inline __attribute__((always_inline)) void q4tx_tile(const uint8_t *r, const float *st, const float *mt,
                                                            int64_t in, int64_t g, int64_t groups, int NR,
                                                            const int32_t *c, int64_t cs, const int32_t *bneg,
                                                            const float *bd, int64_t bs, const float *xs,
                                                            float *yk, int64_t ys) {
    const int64_t blocks = in / XQ_BLOCK;
    vf acc[ROWS_A_PASS];
    for (int k = 0; k < NR; k++) acc[k] = vzero();
    for (int64_t b = 0; b < blocks; b++) {
        __m512i p[ROWS_A_PASS];
        for (int k = 0; k < NR; k++) p[k] = _mm512_set1_epi32(bneg[k * bs + b]);
        for (int64_t i = b * XQ_BLOCK; i < (b + 1) * XQ_BLOCK; i += 8) {
            const uint8_t *rb = r + TILE_STEP(i);
            PREFETCH(rb);
            __m512i v = _mm512_loadu_si512(rb);
            __m512i lo = LOW_NIBBLES_XOR(v, 8), hi = LOW_NIBBLES_XOR(_mm512_srli_epi32(v, 4), 8);
            for (int k = 0; k < NR; k++) {
                p[k] = _mm512_dpbusd_epi32(p[k], lo, _mm512_set1_epi32(c[k * cs + i / 4]));
                p[k] = _mm512_dpbusd_epi32(p[k], hi, _mm512_set1_epi32(c[k * cs + i / 4 + 1]));
            }
        }
        vf sv = vload(st + b * XQ_BLOCK / g * TILE_ROWS);
        for (int k = 0; k < NR; k++) acc[k] = vfma(_mm512_cvtepi32_ps(p[k]), vmul(sv, vset1(bd[k * bs + b])), acc[k]);
    }
    if (mt)
        for (int k = 0; k < NR; k++)
            for (int64_t j = 0; j < groups; j++) acc[k] = vfma(vload(mt + j * TILE_ROWS), vset1(xs[k * groups + j]), acc[k]);
    for (int k = 0; k < NR; k++) _mm_storeu_acc(yk + k * ys, acc[k]);
}

static int int_matvec_q4t_rows(const uint8_t *q, const float *s, const float *m, const float *x, float *y,
                               int64_t out, int64_t in, int64_t g, int64_t B, int nt) {
    const int64_t np = (in + XQ_PAD - 1) / XQ_PAD * XQ_PAD, groups = in / g, blocks = in / XQ_BLOCK;
    const int64_t tiles = out / TILE_ROWS, cs = np / 4;
    int32_t *c = malloc(sizeof(int32_t) * (size_t)(B * (2 * cs + blocks)));
    float *f = malloc(sizeof(float) * (size_t)(B * (cs + blocks + groups)));
    if (!c || !f) {
        free(c), free(f);
        return 0;
    }
    int32_t *neg = c + B * cs, *bneg = neg + B * cs;
    float *d = f, *bd = d + B * cs, *xs = bd + B * blocks;
    for (int64_t k = 0; k < B; k++) { /* each row as int_matvec_q4t prepares its x */
        quantize_x(x + k * in, in, 8, ORDER_TILES, (int8_t *)(c + k * cs), neg + k * cs, d + k * cs);
        for (int64_t b = 0; b < blocks; b++) {
            int32_t t = 0;
            for (int l = 0; l < XQ_BLOCK / 4; l++) t += neg[k * cs + b * XQ_BLOCK / 4 + l];
            bneg[k * blocks + b] = t;
            bd[k * blocks + b] = d[k * cs + b * XQ_BLOCK / 4];
        }
        if (m) group_sums(x + k * in, xs + k * groups, groups, g);
    }
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const uint8_t *r = q + t * TILE_ROWS * in / 2;
        const float *st = s + t * TILE_ROWS * groups, *mt = m ? m + t * TILE_ROWS * groups : NULL;
        for (int64_t k0 = 0; k0 < B; k0 += ROWS_A_PASS) {
            const int32_t *ck = c + k0 * cs, *nk = bneg + k0 * blocks;
            const float *dk = bd + k0 * blocks, *xk = xs + k0 * groups;
            float *yk = y + k0 * out + t * TILE_ROWS;
            switch (B - k0 < ROWS_A_PASS ? B - k0 : ROWS_A_PASS) { /* a constant NR each: the loops unrolled */
#define Q4TX_CASE(N) \
    case N: q4tx_tile(r, st, mt, in, g, groups, N, ck, cs, nk, dk, blocks, xk, yk, out); break;
                Q4TX_CASE(1) Q4TX_CASE(2) Q4TX_CASE(3) Q4TX_CASE(4) Q4TX_CASE(5) Q4TX_CASE(6) Q4TX_CASE(7)
                default: q4tx_tile(r, st, mt, in, g, groups, ROWS_A_PASS, ck, cs, nk, dk, blocks, xk, yk, out);
#undef Q4TX_CASE
            }
        }
    }
    free(c), free(f);
    return 1;
}
#endif

#if XQ_STEP == 64
/* int8 codes in rows against NR rows of x: each row's lanes as INT_ROW(int_row_q8) computes them. */
static inline __attribute__((always_inline)) void q8x_row(const int8_t *r, const float *so, int64_t in, int64_t g,
                                                          int NR, const int8_t *c, const int32_t *neg,
                                                          const float *d, int64_t cs, float *yk, int64_t ys) {
    __m512 acc[ROWS_A_PASS], acc1[ROWS_A_PASS];
    for (int k = 0; k < NR; k++) acc[k] = acc1[k] = _mm512_setzero_ps();
#define STEP_K(A, i, SCALE) A[k] = dot_step(u, c + k * 4 * cs, neg + k * cs, i, SCALE, A[k])
    if (g % 64 == 0) {
        for (int64_t j = 0; j < in / g; j++) {
            __m512 p0[ROWS_A_PASS], p1[ROWS_A_PASS];
            for (int k = 0; k < NR; k++) p0[k] = p1[k] = _mm512_setzero_ps();
            int64_t i = j * g, end = i + g;
            for (; i + 128 <= end; i += 128) {
                vu u = u_q8(r, i, in);
                for (int k = 0; k < NR; k++) STEP_K(p0, i, _mm512_loadu_ps(d + k * cs + i / 4));
                u = u_q8(r, i + 64, in);
                for (int k = 0; k < NR; k++) STEP_K(p1, i + 64, _mm512_loadu_ps(d + k * cs + (i + 64) / 4));
            }
            if (i < end) {
                vu u = u_q8(r, i, in);
                for (int k = 0; k < NR; k++) STEP_K(p0, i, _mm512_loadu_ps(d + k * cs + i / 4));
            }
            __m512 sj = _mm512_set1_ps(so[j]);
            for (int k = 0; k < NR; k++) acc[k] = _mm512_fmadd_ps(sj, _mm512_add_ps(p0[k], p1[k]), acc[k]);
        }
    } else {
        int64_t i = 0;
        for (; i + 128 <= in; i += 128) {
            vu u = u_q8(r, i, in);
            __m512 sp = scale_pair(so, i, in, g, ORDER_PLAIN);
            for (int k = 0; k < NR; k++) STEP_K(acc, i, _mm512_mul_ps(_mm512_loadu_ps(d + k * cs + i / 4), sp));
            u = u_q8(r, i + 64, in);
            sp = scale_pair(so, i + 64, in, g, ORDER_PLAIN);
            for (int k = 0; k < NR; k++) STEP_K(acc1, i + 64, _mm512_mul_ps(_mm512_loadu_ps(d + k * cs + (i + 64) / 4), sp));
        }
        for (; i < in; i += 64) {
            vu u = u_q8(r, i, in);
            __m512 sp = scale_pair(so, i, in, g, ORDER_PLAIN);
            for (int k = 0; k < NR; k++) STEP_K(acc, i, _mm512_mul_ps(_mm512_loadu_ps(d + k * cs + i / 4), sp));
        }
        for (int k = 0; k < NR; k++) acc[k] = _mm512_add_ps(acc[k], acc1[k]);
    }
#undef STEP_K
    for (int k = 0; k < NR; k++) yk[k * ys] = _mm512_reduce_add_ps(acc[k]);
}

static int int_matvec_q8_rows(const int8_t *q, const float *s, const float *m, const float *x, float *y,
                              int64_t out, int64_t in, int64_t g, int64_t B, int nt) {
    const int64_t np = (in + XQ_PAD - 1) / XQ_PAD * XQ_PAD, groups = in / g, cs = np / 4;
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
    for (int64_t o = 0; o < out; o++) {
        const int8_t *r = q + o * in;
        const float *so = s + o * groups;
        for (int64_t k0 = 0; k0 < B; k0 += 4) { /* four rows a pass: two accumulators each, what registers hold */
            const int8_t *ck = c + k0 * np;
            const int32_t *nk = neg + k0 * cs;
            const float *dk = d + k0 * cs;
            float *yk = y + k0 * out + o;
            switch (B - k0 < 4 ? B - k0 : 4) {
            case 1: q8x_row(r, so, in, g, 1, ck, nk, dk, cs, yk, out); break;
            case 2: q8x_row(r, so, in, g, 2, ck, nk, dk, cs, yk, out); break;
            case 3: q8x_row(r, so, in, g, 3, ck, nk, dk, cs, yk, out); break;
            default: q8x_row(r, so, in, g, 4, ck, nk, dk, cs, yk, out);
            }
            if (m)
                for (int64_t k = k0; k < B && k < k0 + 4; k++) y[k * out + o] += dot_f32(m + o * groups, xs + k * groups, groups);
        }
    }
    free(c), free(neg), free(f);
    return 1;
}
#endif

/* The exported products of B rows with int8 activations: each row its kv_matvec_q4tx / kv_matvec_q8x product. */
void kv_matvec_q4tx_rows(const uint8_t *q, const float *s, const float *m, const float *x, float *y, int64_t out,
                         int64_t in, int64_t g, int64_t B, int nt) {
#if INT_TILES
    if (int_products_fit(in, g) && int_matvec_q4t_rows(q, s, m, x, y, out, in, g, B, nt)) return;
#endif
    for (int64_t k = 0; k < B; k++) kv_matvec_q4tx(q, s, m, x + k * in, y + k * out, out, in, g, nt);
}
void kv_matvec_q8x_rows(const int8_t *q, const float *s, const float *m, const float *x, float *y, int64_t out,
                        int64_t in, int64_t g, int64_t B, int nt) {
#if XQ_STEP == 64
    if (int_products_fit(in, g) && int_matvec_q8_rows(q, s, m, x, y, out, in, g, B, nt)) return;
#endif
    for (int64_t k = 0; k < B; k++) kv_matvec_q8x(q, s, m, x + k * in, y + k * out, out, in, g, nt);
}
