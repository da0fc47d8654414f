#include "simd.h"
#include "kernels.h"
#include <stdlib.h>

/* ---- Prefill's products from int4 codes in tiles: many rows of x, the weights dequantized in the thread's L1 ----
 * A prompt's forward multiplies M rows of x [M, in] by every weight. torch's GEMM wants the weights as float32
 * rows, so the int4 path dequantized each layer into a buffer of 4 bytes a weight, written to memory and read
 * back, once per prefill step. Here a thread dequantizes a pair of tiles (32 output rows) KB inputs at a time
 * into a 16 KiB block of its own ([2][KB][16] floats, s·q + m as kv_dequant_q4t computes them) and multiplies it
 * by the rows of x at once: x packed [in][MR] for MR rows, each step of k one 64-byte load of each tile's 16
 * weights and MR broadcasts of x, 2·MR FMAs into MR × 32 outputs held in registers (24 accumulators). The
 * FMAs are the work; the loads are half of them and the dequantization a fraction of a percent. Rows of x are
 * taken MC at a time, MC × in floats kept within 1 MiB (the thread's L2 with its weights). Each output is
 * float32 sums of the products in order of k: the dequantized weights' products as torch's GEMM sums them, up
 * to that order. engine/BENCHMARKS.md, "Prefill's products from int4 tiles", has the measurements. */
#if KV_LANES == 16
#define TILE_KB 128 /* inputs a dequantized block: 2 tiles × 128 × 16 floats = 16 KiB */
#define TILE_MR 12  /* rows of x a pass: 12 × 2 accumulators, 2 weight vectors, the broadcast */

/* Rows R (≤ TILE_MR) of x packed [kn][TILE_MR] (xp) by NT (1 or 2) tiles' dequantized block wt [NT][TILE_KB][16]:
 * y [R, NT·16] (rows `out` apart) set (first) or added to. R and NT are constants where it is inlined. */
static inline __attribute__((always_inline)) void block_rows(const float *wt, int64_t kn, const float *xp, float *y,
                                                             int64_t out, int R, int NT, int first) {
    vf acc[TILE_MR][2];
    _Pragma("GCC unroll 12") for (int r = 0; r < R; r++)
        _Pragma("GCC unroll 2") for (int c = 0; c < NT; c++)
            acc[r][c] = first ? vzero() : vload(y + r * out + c * TILE_ROWS);
    for (int64_t k = 0; k < kn; k++) {
        vf w0 = _mm512_load_ps(wt + k * TILE_ROWS), w1 = NT > 1 ? _mm512_load_ps(wt + (TILE_KB + k) * TILE_ROWS) : w0;
        _Pragma("GCC unroll 12") for (int r = 0; r < R; r++) {
            vf xv = vset1(xp[k * TILE_MR + r]);
            acc[r][0] = vfma(w0, xv, acc[r][0]);
            if (NT > 1) acc[r][1] = vfma(w1, xv, acc[r][1]);
        }
    }
    _Pragma("GCC unroll 12") for (int r = 0; r < R; r++)
        _Pragma("GCC unroll 2") for (int c = 0; c < NT; c++) _mm512_storeu_ps(y + r * out + c * TILE_ROWS, acc[r][c]);
}

/* One tile's inputs kb..kb+kn as float32 weights, wt [kn][16] = s·q + m of its 16 rows (64-byte aligned). */
static void tile_block(const uint8_t *r, const float *st, const float *mt, int64_t kb, int64_t kn, int64_t g,
                       float *wt) {
    const vf values = int4_values();
    for (int64_t i = kb; i < kb + kn; i += 8) {
        vi v = _mm512_loadu_si512(r + TILE_STEP(i));
        const int64_t j = i / g;
        vf sv = vload(st + j * TILE_ROWS), mv = mt ? vload(mt + j * TILE_ROWS) : vzero();
        float *d = wt + (i - kb) * TILE_ROWS;
        for (int k = 0; k < 8; k++) /* input i + k: nibble k of each lane */
            _mm512_store_ps(d + k * TILE_ROWS, vfma(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4 * k), values), sv, mv));
    }
}

/* R rows by NT tiles, R and NT constants for block_rows (its loops unrolled) */
static void rows_by_tiles(const float *wt, int64_t kn, const float *xp, float *y, int64_t out, int R, int NT,
                          int first) {
#define ROWS_CASE(N)                                                   \
    case N:                                                            \
        if (NT == 2) block_rows(wt, kn, xp, y, out, N, 2, first);      \
        else block_rows(wt, kn, xp, y, out, N, 1, first);              \
        break;
    switch (R) {
        ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7) ROWS_CASE(8)
        ROWS_CASE(9) ROWS_CASE(10) ROWS_CASE(11)
    default:
        if (NT == 2) block_rows(wt, kn, xp, y, out, TILE_MR, 2, first);
        else block_rows(wt, kn, xp, y, out, TILE_MR, 1, first);
    }
#undef ROWS_CASE
}
#endif

/* y [M, out] = x [M, in] · Wᵀ for W the int4 tiles q (s, m as kv_matvec_q4t takes them). 1 when done; 0 where it
 * does not run (no 16-lane vectors, a group that splits a tile's 8-input step, no memory): the caller's GEMM then. */
int kv_gemm_q4t(const uint8_t *q, const float *s, const float *m, const float *x, float *y, int64_t out, int64_t in,
                int64_t g, int64_t M, int nt) {
#if KV_LANES == 16
    if (g % 8 || in % 8 || out % TILE_ROWS || M < 1) return 0;
    const int64_t tiles = out / TILE_ROWS, groups = in / g, pairs = (tiles + 1) / 2;
    int64_t mc = (int64_t)(1 << 20) / (in * 4) / TILE_MR * TILE_MR; /* rows of x a pass over the weights */
    if (mc < TILE_MR) mc = TILE_MR;
    if (mc > M) mc = (M + TILE_MR - 1) / TILE_MR * TILE_MR;
    float *xp = _mm_malloc(sizeof(float) * (size_t)(mc * in), 64); /* [mc/MR][in][MR] */
    if (!xp) return 0;
    int failed = 0;
#pragma omp parallel num_threads(nt)
    {
        float *wt = _mm_malloc(sizeof(float) * 2 * TILE_KB * TILE_ROWS, 64);
        if (!wt) {
#pragma omp atomic write
            failed = 1;
        }
        for (int64_t m0 = 0; m0 < M; m0 += mc) {
            const int64_t mn = M - m0 < mc ? M - m0 : mc;
#pragma omp for schedule(static)
            for (int64_t a = 0; a < mn; a += TILE_MR) /* rows a.. of the pass as [in][MR], past M zeros */
                for (int64_t k = 0; k < in; k++)
                    for (int r = 0; r < TILE_MR; r++)
                        xp[a * in + k * TILE_MR + r] = a + r < mn ? x[(m0 + a + r) * in + k] : 0.0f;
#pragma omp for schedule(static)
            for (int64_t p = 0; p < pairs; p++) {
                if (!wt) continue; /* every thread meets every loop and barrier; the call reports the failure */
                const int64_t t = 2 * p;
                const int NT = t + 1 < tiles ? 2 : 1;
                for (int64_t kb = 0; kb < in; kb += TILE_KB) {
                    const int64_t kn = in - kb < TILE_KB ? in - kb : TILE_KB;
                    for (int c = 0; c < NT; c++)
                        tile_block(q + (t + c) * TILE_ROWS * in / 2, s + (t + c) * TILE_ROWS * groups,
                                   m ? m + (t + c) * TILE_ROWS * groups : NULL, kb, kn, g, wt + c * TILE_KB * TILE_ROWS);
                    for (int64_t a = 0; a < mn; a += TILE_MR) {
                        const int R = mn - a < TILE_MR ? (int)(mn - a) : TILE_MR;
                        rows_by_tiles(wt, kn, xp + a * in + kb * TILE_MR, y + (m0 + a) * out + t * TILE_ROWS, out, R,
                                      NT, kb == 0);
                    }
                }
            }
        }
        _mm_free(wt);
    }
    _mm_free(xp);
    return !failed;
#else
    (void)q, (void)s, (void)m, (void)x, (void)y, (void)out, (void)in, (void)g, (void)M, (void)nt;
    return 0;
#endif
}
