#include "integer_codes.h"
#include <stdlib.h>
/* ---- int8 codes in tiles of 16 rows against int8 activations (512-bit VNNI): one row of x, and several ----
 * The int4 tiles' layout (engine.quant.tile, unit 4 bytes) with a byte a code: a 64-byte step holds 4 inputs of 16
 * rows, a row's 4 bytes to a 32-bit lane, so one vpdpbusd against x's 4 codes of those inputs broadcast adds them
 * to 16 rows at once, and each block of 32 inputs (8 steps) starts its lanes from -128 · (x's codes' sum) and ends
 * in one FMA with d · s for the 16 rows. In rows each step took a multiply-add, a conversion and an FMA for one
 * row: several rows of x (a batched decode step, the output head of an int4 model) were bound by them. The one-row
 * product and the several-rows one run each row of x through the same instructions in the same order (tile_q8x),
 * so a row's result is bit for bit the same whatever rows run beside it. */
#define TILE8_STEP(i) ((i) / 4 * TILE_ROWS * 4) /* bytes of a tile before the 4-input step holding input i */

#if INT_TILES
/* One tile against NR rows of x: c [NR][np/4] their codes 4 a lane, per row and block its -128 · (codes' sum) and
 * scale d, per row its group sums xs (offsets); row k's 16 outputs at yk + k · ys. */
static inline __attribute__((always_inline)) void tile_q8x(const int8_t *r, const float *st, const float *mt,
                                                           int64_t in, int64_t g, int64_t groups, int NR,
                                                           const int32_t *c, int64_t cs, const int32_t *bneg,
                                                           const float *bd, int64_t bs, const float *xs, float *yk,
                                                           int64_t ys) {
    const int64_t blocks = in / XQ_BLOCK;
    vf acc[ROWS_A_PASS];
    for (int k = 0; k < NR; k++) acc[k] = vzero();
    for (int64_t b = 0; b < blocks; b++) {
        __m512i p[ROWS_A_PASS];
        for (int k = 0; k < NR; k++) p[k] = _mm512_set1_epi32(bneg[k * bs + b]);
        for (int64_t i = b * XQ_BLOCK; i < (b + 1) * XQ_BLOCK; i += 4) {
            const int8_t *rb = r + TILE8_STEP(i);
            PREFETCH(rb);
            __m512i u = _mm512_xor_si512(_mm512_loadu_si512(rb), _mm512_set1_epi8((char)0x80)); /* q + 128 */
            for (int k = 0; k < NR; k++) p[k] = _mm512_dpbusd_epi32(p[k], u, _mm512_set1_epi32(c[k * cs + i / 4]));
        }
        vf sv = vload(st + b * XQ_BLOCK / g * TILE_ROWS);
        for (int k = 0; k < NR; k++) acc[k] = vfma(_mm512_cvtepi32_ps(p[k]), vmul(sv, vset1(bd[k * bs + b])), acc[k]);
    }
    if (mt)
        for (int k = 0; k < NR; k++)
            for (int64_t j = 0; j < groups; j++) acc[k] = vfma(vload(mt + j * TILE_ROWS), vset1(xs[k * groups + j]), acc[k]);
    for (int k = 0; k < NR; k++) _mm_storeu_acc(yk + k * ys, acc[k]);
}

#define TILE8_BYTES(in) (TILE_ROWS * (in)) /* a tile of int8 codes */
TILES_BY_ROWS(int_matvec_q8t, int8_t, TILE8_BYTES, tile_q8x, 128, ORDER_PLAIN)
#endif

int kv_int8_integer_tiles(void) { return INT_TILES && kv_int4_tile_rows(); }

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
