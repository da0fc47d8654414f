#include "integer_codes.h"
#include <stdlib.h>
/* ---- Codes in tiles of 16 rows against int8 activations (512-bit VNNI): one row of x, and several ----
 * A tile holds 16 rows side by side, 4 bytes of each in turn (engine.quant.tile, unit 4), so a 64-byte load is one
 * step of 16 rows and a 32-bit lane is one row's: int4 codes two a byte (8 inputs a step; its low nibbles, the even
 * inputs, and its high ones, the odd, enter vpdpbusd as q + 8), int8 codes a byte each (4 inputs a step, as
 * q + 128). Against x's codes of the step's inputs broadcast, one vpdpbusd adds them to 16 rows at once; each block
 * of 32 inputs starts its lanes from -bias · (x's codes' sum) and ends in one FMA with d · s for the 16 rows. In
 * rows each step of int8 codes took a multiply-add, a conversion and an FMA for one row, so several rows of x (a
 * batched decode step, the output head of an int4 model) were bound by them. One row of x and several run each row
 * through the same instructions in the same order (tile_dot), so a row's result is bit for bit the same whatever
 * rows run beside it. */
#define ROWS_A_PASS 8                           /* rows of x a pass over a tile */
#define TILE8_STEP(i) ((i) / 4 * TILE_ROWS * 4) /* bytes of an int8 tile before the 4-input step holding input i */

#if INT_TILES
/* One tile of BITS-bit codes against NR rows of x: c [NR][np/4] their codes 4 a lane (int4: each 8 inputs' evens,
 * then odds), per row and block its -bias · (codes' sum) and scale d, per row its group sums xs (offsets); row k's
 * 16 outputs at yk + k · ys. BITS and NR are constants where it is inlined: its loops unrolled. */
static inline __attribute__((always_inline)) void tile_dot(const uint8_t *r, const float *st, const float *mt,
                                                           int64_t in, int64_t g, int64_t groups, int NR,
                                                           const int32_t *c, int64_t cs, const int32_t *bneg,
                                                           const float *bd, int64_t bs, const float *xs, float *yk,
                                                           int64_t ys, int BITS) {
    const int64_t blocks = in / XQ_BLOCK, step = BITS == 4 ? 8 : 4;
    vf acc[ROWS_A_PASS];
    for (int k = 0; k < NR; k++) acc[k] = vzero();
    for (int64_t b = 0; b < blocks; b++) {
        __m512i p[ROWS_A_PASS];
        for (int k = 0; k < NR; k++) p[k] = _mm512_set1_epi32(bneg[k * bs + b]);
        for (int64_t i = b * XQ_BLOCK; i < (b + 1) * XQ_BLOCK; i += step) {
            const uint8_t *rb = r + (BITS == 4 ? TILE_STEP(i) : TILE8_STEP(i));
            PREFETCH(rb);
            __m512i v = _mm512_loadu_si512(rb);
            if (BITS == 4) {
                __m512i lo = LOW_NIBBLES_XOR(v, 8), hi = LOW_NIBBLES_XOR(_mm512_srli_epi32(v, 4), 8);
                for (int k = 0; k < NR; k++) {
                    p[k] = _mm512_dpbusd_epi32(p[k], lo, _mm512_set1_epi32(c[k * cs + i / 4]));
                    p[k] = _mm512_dpbusd_epi32(p[k], hi, _mm512_set1_epi32(c[k * cs + i / 4 + 1]));
                }
            } else {
                __m512i u = _mm512_xor_si512(v, _mm512_set1_epi8((char)0x80)); /* q + 128 */
                for (int k = 0; k < NR; k++) p[k] = _mm512_dpbusd_epi32(p[k], u, _mm512_set1_epi32(c[k * cs + i / 4]));
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

/* B rows of x (rows `in` apart) for the tiles' products with B rows: each row's codes c (4 a lane, np/4 lanes a
 * row) and its lanes' -bias · sums and scales (quantize_x), then per block of 32 their sum (bneg) and scale (bd), and
 * with offsets (m) the rows' group sums xs. */
static inline void tile_rows_x(const float *x, int64_t B, int64_t in, int64_t g, const float *m, int bias, int order,
                               int32_t *c, int32_t *neg, float *d, int32_t *bneg, float *bd, float *xs) {
    const int64_t cs = XQ_NP(in) / 4, blocks = in / XQ_BLOCK, groups = in / g;
    for (int64_t k = 0; k < B; k++) {
        quantize_x(x + k * in, in, bias, order, (int8_t *)(c + k * cs), neg + k * cs, d + k * cs);
        for (int64_t b = 0; b < blocks; b++) {
            int32_t t = 0;
            for (int l = 0; l < XQ_BLOCK / 4; l++) t += neg[k * cs + b * XQ_BLOCK / 4 + l];
            bneg[k * blocks + b] = t;
            bd[k * blocks + b] = d[k * cs + b * XQ_BLOCK / 4];
        }
        if (m) group_sums(x + k * in, xs + k * groups, groups, g);
    }
}

/* B rows of x (rows `in` apart) against BITS-bit codes in tiles: y [B, out]. x prepared once (tile_rows_x), then each
 * tile against the rows, ROWS_A_PASS of them a pass with a constant count each. 0 where its buffers could not be had. */
static inline __attribute__((always_inline)) int tiles_by_rows(const uint8_t *q, const float *s, const float *m,
                                                               const float *x, float *y, int64_t out, int64_t in,
                                                               int64_t g, int64_t B, int nt, int BITS) {
    const int64_t np = XQ_NP(in), groups = in / g, blocks = in / XQ_BLOCK;
    const int64_t tiles = out / TILE_ROWS, cs = np / 4;
    int32_t *c = malloc(sizeof(int32_t) * (size_t)(B * (2 * cs + blocks)));
    float *f = malloc(sizeof(float) * (size_t)(B * (cs + blocks + groups)));
    if (!c || !f) {
        free(c), free(f);
        return 0;
    }
    int32_t *neg = c + B * cs, *bneg = neg + B * cs;
    float *d = f, *bd = d + B * cs, *xs = bd + B * blocks;
    tile_rows_x(x, B, in, g, m, BITS == 4 ? 8 : 128, BITS == 4 ? ORDER_TILES : ORDER_PLAIN, c, neg, d, bneg, bd, xs);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const uint8_t *r = q + t * TILE_ROWS * in * BITS / 8;
        const float *st = s + t * TILE_ROWS * groups, *mt = m ? m + t * TILE_ROWS * groups : NULL;
        for (int64_t k0 = 0; k0 < B; k0 += ROWS_A_PASS) {
            const int32_t *ck = c + k0 * cs, *nk = bneg + k0 * blocks;
            const float *dk = bd + k0 * blocks, *xk = xs + k0 * groups;
            float *yk = y + k0 * out + t * TILE_ROWS;
            switch (B - k0 < ROWS_A_PASS ? B - k0 : ROWS_A_PASS) { /* a constant NR each: the loops unrolled */
#define TILE_CASE(N) \
    case N: tile_dot(r, st, mt, in, g, groups, N, ck, cs, nk, dk, blocks, xk, yk, out, BITS); break;
                TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4) TILE_CASE(5) TILE_CASE(6) TILE_CASE(7)
                default: tile_dot(r, st, mt, in, g, groups, ROWS_A_PASS, ck, cs, nk, dk, blocks, xk, yk, out, BITS);
#undef TILE_CASE
            }
        }
    }
    free(c), free(f);
    return 1;
}
static int int_matvec_q4t(const uint8_t *q, const float *s, const float *m, const float *x, float *y, int64_t out,
                          int64_t in, int64_t g, int64_t B, int nt) {
    return tiles_by_rows(q, s, m, x, y, out, in, g, B, nt, 4);
}
static int int_matvec_q8t(const int8_t *q, const float *s, const float *m, const float *x, float *y, int64_t out,
                          int64_t in, int64_t g, int64_t B, int nt) {
    return tiles_by_rows((const uint8_t *)q, s, m, x, y, out, in, g, B, nt, 8);
}
#endif

int kv_int4_integer_tiles(void) { return INT_TILES && kv_int4_tile_rows(); }
int kv_int8_integer_tiles(void) { return INT_TILES && kv_int4_tile_rows(); }

/* The exported int4 tiles' products with int8 activations: integer where they run and the shape fits, the float
 * product (kv_matvec_q4t) otherwise; B rows, each row its one-row product. */
void kv_matvec_q4tx(const uint8_t *q, const float *s, const float *m, const float *x, float *y, int64_t out,
                    int64_t in, int64_t g, int nt) {
#if INT_TILES
    if (int_products_fit(in, g) && int_matvec_q4t(q, s, m, x, y, out, in, g, 1, nt)) return;
#endif
    kv_matvec_q4t(q, s, m, x, y, out, in, g, nt);
}
void kv_matvec_q4tx_rows(const uint8_t *q, const float *s, const float *m, const float *x, float *y, int64_t out,
                         int64_t in, int64_t g, int64_t B, int nt) {
#if INT_TILES
    if (int_products_fit(in, g) && int_matvec_q4t(q, s, m, x, y, out, in, g, B, nt)) return;
#endif
    for (int64_t k = 0; k < B; k++) kv_matvec_q4tx(q, s, m, x + k * in, y + k * out, out, in, g, nt);
}

/* The tiles read back as float32 rows for prefill's products: w [out, in] = s · q (+ m), as kv_dequant_q8 gives a
 * row. With 16-lane vectors a tile at a time: each 64-byte step's 16 rows × 4 codes widened in four quarters of 4 rows,
 * each row's 4 values stored in its row; else a row at a time, its bytes in the thread's cache for the tile's others. */
void kv_dequant_q8t(const int8_t *q, const float *s, const float *m, float *w, int64_t out, int64_t in, int64_t g,
                    int nt) {
    int64_t groups = in / g;
#if KV_LANES == 16
    const __m512i quad = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t t = 0; t < out / TILE_ROWS; t++) {
        const int8_t *r = q + t * TILE_ROWS * in;
        float *d = w + t * TILE_ROWS * in;
        for (int64_t j = 0; j < groups; j++) {
            __m512 sv = _mm512_loadu_ps(s + (t * groups + j) * TILE_ROWS);
            __m512 mv = m ? _mm512_loadu_ps(m + (t * groups + j) * TILE_ROWS) : _mm512_setzero_ps();
            __m512 sc[4], mn[4]; /* quarter k: rows 4k..4k+3, each's scale on its 4 lanes */
            for (int k = 0; k < 4; k++) {
                __m512i at = _mm512_add_epi32(quad, _mm512_set1_epi32(4 * k));
                sc[k] = _mm512_permutexvar_ps(at, sv), mn[k] = _mm512_permutexvar_ps(at, mv);
            }
            for (int64_t i = j * g; i < (j + 1) * g; i += 4) {
                __m512i v = _mm512_loadu_si512(r + TILE8_STEP(i));
#define QUARTER(K) /* (extracts take constant lanes) */                                                     \
    do {                                                                                                    \
        __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(v, K)));               \
        f = _mm512_fmadd_ps(f, sc[K], mn[K]);                                                               \
        _mm_storeu_ps(d + (4 * K + 0) * in + i, _mm512_extractf32x4_ps(f, 0));                              \
        _mm_storeu_ps(d + (4 * K + 1) * in + i, _mm512_extractf32x4_ps(f, 1));                              \
        _mm_storeu_ps(d + (4 * K + 2) * in + i, _mm512_extractf32x4_ps(f, 2));                              \
        _mm_storeu_ps(d + (4 * K + 3) * in + i, _mm512_extractf32x4_ps(f, 3));                              \
    } while (0)
                QUARTER(0);
                QUARTER(1);
                QUARTER(2);
                QUARTER(3);
#undef QUARTER
            }
        }
    }
#else
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t o = 0; o < out; o++) {
        int64_t t = o / TILE_ROWS, l = o % TILE_ROWS, at = t * TILE_ROWS * groups + l;
        const int8_t *r = q + t * TILE_ROWS * in + 4 * l;
        float *d = w + o * in;
        for (int64_t j = 0; j < groups; j++) {
            float sc = s[at + j * TILE_ROWS], mn = m ? m[at + j * TILE_ROWS] : 0.0f;
            for (int64_t i = j * g; i < (j + 1) * g; i += 4) {
                const int8_t *b = r + TILE8_STEP(i);
                for (int k = 0; k < 4; k++) d[i + k] = sc * (float)b[k] + mn;
            }
        }
    }
#endif
}

/* The exported products of int8 tiles: one row (the decode step's), and B rows, each row the one-row product. Only
 * where they run (kv_int8_integer_tiles) and the shape fits: the loader lays int8 codes in tiles only then. */
void kv_matvec_q8tx(const int8_t *q, const float *s, const float *m, const float *x, float *y, int64_t out,
                    int64_t in, int64_t g, int nt) {
    kv_matvec_q8tx_rows(q, s, m, x, y, out, in, g, 1, nt);
}
void kv_matvec_q8tx_rows(const int8_t *q, const float *s, const float *m, const float *x, float *y, int64_t out,
                         int64_t in, int64_t g, int64_t B, int nt) {
#if INT_TILES
    if (int_products_fit(in, g) && out % TILE_ROWS == 0 && int_matvec_q8t(q, s, m, x, y, out, in, g, B, nt)) return;
#endif
    (void)q, (void)s, (void)m, (void)x, (void)g, (void)nt;
    for (int64_t i = 0; i < B * out; i++) y[i] = NAN; /* never laid out here: a NaN the checks see, not memory read */
}
