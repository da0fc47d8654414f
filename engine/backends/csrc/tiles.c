#include "simd.h"
#include "kernels.h"

/* ---- int4 codes in tiles of 16 rows, for one-row products (float32 activations here, int8 ones in integer_products.c) ----
 * A row's 32 inputs against its 16 bytes of codes leave the vector unit converting nibbles more than
 * multiplying. Sixteen rows side by side make each vector lane one row: a 64-byte load holds 8 inputs of
 * 16 rows, each nibble meets its input's x broadcast to every lane, and the scales (one per row and group)
 * apply once per group to 16 rows at once. Layout, engine.quant.tile's: codes
 * [out/16][in/8][16 rows][4 bytes] — each 4 bytes are 8 inputs of one row as the row layout holds them
 * (input 8b+k in nibble k, low nibble first) — and scales and offsets [out/16][in/g][16 rows]. */
int kv_int4_tile_rows(void) { return KV_LANES == 16 ? TILE_ROWS : 0; }

void kv_matvec_q4t(const uint8_t *q, const float *s, const float *m, const float *x, float *y, int64_t out,
                   int64_t in, int64_t g, int nt) {
    int64_t groups = in / g, tiles = out / TILE_ROWS;
    float xs[groups];
    if (m) group_sums(x, xs, groups, g);
#if KV_LANES == 16
    const vf values = int4_values();
#if defined(__AVX512VBMI__) /* a lane's byte 2 or 3 moved to its byte 0 by vpermb, on another port than shifts */
    const vi lane_bytes = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60), _mm512_set1_epi32(0x01010101));
    const vi byte2 = _mm512_add_epi8(lane_bytes, _mm512_set1_epi8(2)), byte3 = _mm512_add_epi8(lane_bytes, _mm512_set1_epi8(3));
#define HIGH_BYTE(v, k) _mm512_permutexvar_epi8((k) == 2 ? byte2 : byte3, v)
#else
#define HIGH_BYTE(v, k) _mm512_srli_epi32(v, 8 * (k))
#endif
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const uint8_t *r = q + t * TILE_ROWS * in / 2;
        const float *st = s + t * TILE_ROWS * groups, *mt = m ? m + t * TILE_ROWS * groups : NULL;
        vf acc = vzero();
        for (int64_t j = 0; j < groups; j++) {
            vf p0 = vzero(), p1 = vzero(), p2 = vzero(), p3 = vzero();
            for (int64_t i = j * g; i < (j + 1) * g; i += 8) {
                const uint8_t *b = r + TILE_STEP(i); /* 64 bytes: inputs i..i+7 of the 16 rows */
                PREFETCH(b);
                vi v = _mm512_loadu_si512(b), v4 = _mm512_srli_epi32(v, 4);
                /* nibble k to index bits 0-3 (vpermps reads no others): shifts for k = 1-3, then bytes 2, 3 */
                p0 = vfma(_mm512_permutexvar_ps(v, values), vset1(x[i]), p0);
                p1 = vfma(_mm512_permutexvar_ps(v4, values), vset1(x[i + 1]), p1);
                p2 = vfma(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 8), values), vset1(x[i + 2]), p2);
                p3 = vfma(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 12), values), vset1(x[i + 3]), p3);
                p0 = vfma(_mm512_permutexvar_ps(HIGH_BYTE(v, 2), values), vset1(x[i + 4]), p0);
                p1 = vfma(_mm512_permutexvar_ps(HIGH_BYTE(v4, 2), values), vset1(x[i + 5]), p1);
                p2 = vfma(_mm512_permutexvar_ps(HIGH_BYTE(v, 3), values), vset1(x[i + 6]), p2);
                p3 = vfma(_mm512_permutexvar_ps(HIGH_BYTE(v4, 3), values), vset1(x[i + 7]), p3);
            }
            acc = vfma(vload(st + j * TILE_ROWS), vadd(vadd(p0, p1), vadd(p2, p3)), acc);
            if (mt) acc = vfma(vload(mt + j * TILE_ROWS), vset1(xs[j]), acc);
        }
        _mm_storeu_acc(y + t * TILE_ROWS, acc);
    }
#undef HIGH_BYTE
#else
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t o = 0; o < tiles * TILE_ROWS; o++) {
        int64_t t = o / TILE_ROWS, l = o % TILE_ROWS;
        const uint8_t *r = q + t * TILE_ROWS * in / 2 + 4 * l;
        const float *st = s + t * TILE_ROWS * groups + l;
        float a = 0;
        for (int64_t j = 0; j < groups; j++) {
            float p = 0;
            for (int64_t i = j * g; i < (j + 1) * g; i++)
                p += (float)int4_value(r[TILE_STEP(i) + i % 8 / 2] >> (4 * (i & 1))) * x[i];
            a += st[j * TILE_ROWS] * p;
            if (m) a += m[t * TILE_ROWS * groups + j * TILE_ROWS + l] * xs[j];
        }
        y[o] = a;
    }
#endif
}

/* Tiled int4 codes -> float32 rows [out, in] = s·q (+ m): what prefill multiplies by. */
void kv_dequant_q4t(const uint8_t *q, const float *s, const float *m, float *w, int64_t out, int64_t in, int64_t g,
                    int nt) {
    int64_t groups = in / g;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256i nibble_shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
#endif
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t o = 0; o < out; o++) {
        int64_t t = o / TILE_ROWS, l = o % TILE_ROWS, at = t * TILE_ROWS * groups + l;
        const uint8_t *r = q + t * TILE_ROWS * in / 2 + 4 * l;
        float *d = w + o * in;
        for (int64_t j = 0; j < groups; j++) {
            float sc = s[at + j * TILE_ROWS], mn = m ? m[at + j * TILE_ROWS] : 0.0f;
            for (int64_t i = j * g; i < (j + 1) * g; i += 8) {
                uint32_t v;
                memcpy(&v, r + TILE_STEP(i), 4);
#if defined(__AVX2__) && defined(__FMA__) /* the 8 nibbles side by side, as int4_value reads each */
                __m256i n = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)v), nibble_shifts), _mm256_set1_epi32(15));
                __m256i c = _mm256_sub_epi32(_mm256_xor_si256(n, _mm256_set1_epi32(8)), _mm256_set1_epi32(8));
                _mm256_storeu_ps(d + i, _mm256_fmadd_ps(_mm256_set1_ps(sc), _mm256_cvtepi32_ps(c), _mm256_set1_ps(mn)));
#else
                for (int k = 0; k < 8; k++) d[i + k] = sc * (float)int4_value(v >> (4 * k)) + mn;
#endif
            }
        }
    }
}
