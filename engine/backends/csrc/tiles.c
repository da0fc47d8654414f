#include "simd.h"
#include "kernels.h"

/* ---- int4 codes in tiles of 16 rows, for one-row products (float32 activations here, int8 ones in integer_products.c) ----
 * A row's 32 inputs against its 16 bytes of codes leave the vector unit converting nibbles more than
 * multiplying. Sixteen rows side by side make each vector lane one row: a 64-byte load holds 8 inputs of
 * 16 rows, each nibble meets its input's x broadcast to every lane, and the scales (one per row and group)
 * apply once per group to 16 rows at once. Layout, engine.quant.tile's: codes
 * [out/16][in/8][16 rows][4 bytes] — each 4 bytes are 8 inputs of one row as the row layout holds them
 * (input 8b+k in nibble k, low nibble first) — and scales and offsets [out/16][in/g][16 rows]. */
int kv_int4_tile_rows(void) { return KV_LANES >= 8 ? TILE_ROWS : 0; }

#if KV_LANES == 8
/* AVX2: a tile's 64-byte step is two vectors of 8 rows, taken one half (8 rows) at a time through a group. Each
 * nibble k of a lane stays where it is: masked (vpand), converted (its value times 16^k is exact in a float) and
 * multiplied by x[i+k]·16^-k (exact too: a power of two), so a nibble costs a mask, a conversion and an FMA, no
 * shift. The codes are 4-bit two's complement: the lanes are XORed with 0x88888888 first, making nibbles 0-6 the
 * code + 8 (their share of 8·x is taken off per group), and nibble 7 is read signed by an arithmetic shift. Four
 * FMA chains cover the FMA's latency; the accumulators, the lane and the masks fit the 16 registers.
 * engine/BENCHMARKS.md, "AVX2: int4 tiles" has the measurements. */
static inline vf q4t_half_group(const uint8_t *b, const float *xk, int64_t steps) {
    vf a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
    for (int64_t n = 0; n < steps; n++, b += TILE_ROWS * 4, xk += 8) {
        PREFETCH(b);
        vi v = _mm256_loadu_si256((const __m256i *)b);
        vi u = _mm256_xor_si256(v, _mm256_set1_epi32((int)0x88888888u));
#define NIB(k) _mm256_cvtepi32_ps(_mm256_and_si256(u, _mm256_set1_epi32(15 << (4 * (k)))))
        a0 = vfma(NIB(0), vset1(xk[0]), a0);
        a1 = vfma(NIB(1), vset1(xk[1]), a1);
        a2 = vfma(NIB(2), vset1(xk[2]), a2);
        a3 = vfma(NIB(3), vset1(xk[3]), a3);
        a0 = vfma(NIB(4), vset1(xk[4]), a0);
        a1 = vfma(NIB(5), vset1(xk[5]), a1);
        a2 = vfma(NIB(6), vset1(xk[6]), a2);
        a3 = vfma(_mm256_cvtepi32_ps(_mm256_srai_epi32(v, 28)), vset1(xk[7]), a3);
#undef NIB
    }
    return vadd(vadd(a0, a1), vadd(a2, a3));
}
#endif

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
#elif KV_LANES == 8
    float xk[in], x8[groups]; /* x[i]·16^-(i%8) (input 7 of each 8 as it is); per group, 8·(x over inputs 0-6 of each 8) */
    static const float step[8] = {1.0f, 0x1p-4f, 0x1p-8f, 0x1p-12f, 0x1p-16f, 0x1p-20f, 0x1p-24f, 1.0f};
    for (int64_t i = 0; i < in; i++) xk[i] = x[i] * step[i % 8];
    for (int64_t j = 0; j < groups; j++) {
        float a = 0;
        for (int64_t i = j * g; i < (j + 1) * g; i++) a += (i % 8 == 7) ? 0.0f : x[i];
        x8[j] = 8 * a;
    }
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const uint8_t *r = q + t * TILE_ROWS * in / 2;
        const float *st = s + t * TILE_ROWS * groups, *mt = m ? m + t * TILE_ROWS * groups : NULL;
        vf acc0 = vzero(), acc1 = vzero(); /* rows 0-7, 8-15 */
        for (int64_t j = 0; j < groups; j++) {
            const uint8_t *b = r + TILE_STEP(j * g); /* the group's steps: 64 bytes, inputs i..i+7 of the 16 rows */
            vf p0 = vsub(q4t_half_group(b, xk + j * g, g / 8), vset1(x8[j]));      /* rows 0-7 */
            vf p1 = vsub(q4t_half_group(b + 32, xk + j * g, g / 8), vset1(x8[j])); /* rows 8-15 */
            acc0 = vfma(vload(st + j * TILE_ROWS), p0, acc0);
            acc1 = vfma(vload(st + j * TILE_ROWS + 8), p1, acc1);
            if (mt) {
                acc0 = vfma(vload(mt + j * TILE_ROWS), vset1(xs[j]), acc0);
                acc1 = vfma(vload(mt + j * TILE_ROWS + 8), vset1(xs[j]), acc1);
            }
        }
        _mm_storeu_acc(y + t * TILE_ROWS, acc0);
        _mm_storeu_acc(y + t * TILE_ROWS + 8, acc1);
    }
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
