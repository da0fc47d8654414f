#include "simd.h"
#include "kernels.h"
#include <stdlib.h>

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

/* One converted lane of weights c into a chain of each of two rows of x. */
static inline void both(vf c, float xa, float xb, vf *a, vf *b) {
    *a = vfma(c, vset1(xa), *a);
    *b = vfma(c, vset1(xb), *b);
}

/* q4t_half_group for two rows of x at once (xa, xb; the same row twice where there is one): each lane's nibbles
 * masked and converted once, each row's four chains as q4t_half_group keeps them. */
static inline void q4t_half_group2(const uint8_t *b, const float *xa, const float *xb, int64_t steps, vf p[2]) {
    vf a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero(), b0 = vzero(), b1 = vzero(), b2 = vzero(), b3 = vzero();
    for (int64_t n = 0; n < steps; n++, b += TILE_ROWS * 4, xa += 8, xb += 8) {
        PREFETCH(b);
        vi v = _mm256_loadu_si256((const __m256i *)b);
        vi u = _mm256_xor_si256(v, _mm256_set1_epi32((int)0x88888888u));
#define NIB(k) _mm256_cvtepi32_ps(_mm256_and_si256(u, _mm256_set1_epi32(15 << (4 * (k)))))
        both(NIB(0), xa[0], xb[0], &a0, &b0);
        both(NIB(1), xa[1], xb[1], &a1, &b1);
        both(NIB(2), xa[2], xb[2], &a2, &b2);
        both(NIB(3), xa[3], xb[3], &a3, &b3);
        both(NIB(4), xa[4], xb[4], &a0, &b0);
        both(NIB(5), xa[5], xb[5], &a1, &b1);
        both(NIB(6), xa[6], xb[6], &a2, &b2);
        both(_mm256_cvtepi32_ps(_mm256_srai_epi32(v, 28)), xa[7], xb[7], &a3, &b3);
#undef NIB
    }
    p[0] = vadd(vadd(a0, a1), vadd(a2, a3));
    p[1] = vadd(vadd(b0, b1), vadd(b2, b3));
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

/* ---- Several rows of x at once (B sequences' decode steps): x [B, in], y [B, out] ----
 * With 16-lane vectors a tile's nibbles become weights once for up to four rows of x, each row's four FMA
 * chains as kv_matvec_q4t keeps them, so every row's outputs are its one-row product's bit for bit while the
 * conversions, the loads and the memory traffic are shared. Elsewhere each row runs kv_matvec_q4t. */
#if KV_LANES == 16
#if defined(__AVX512VBMI__)
#define HIGH_BYTE(v, k) _mm512_permutexvar_epi8((k) == 2 ? byte2 : byte3, v)
#else
#define HIGH_BYTE(v, k) _mm512_srli_epi32(v, 8 * (k))
#endif
#define Q4T_ROWS(NB)                                                                                              \
    static void q4t_tile_rows##NB(const uint8_t *r, const float *st, const float *mt, const float *x,            \
                                  const float *xs, float *y, int64_t in, int64_t out, int64_t g, int64_t groups) { \
        const vf values = int4_values();                                                                         \
        Q4T_LANE_BYTES                                                                                           \
        vf acc[NB];                                                                                              \
        for (int b = 0; b < NB; b++) acc[b] = vzero();                                                          \
        for (int64_t j = 0; j < groups; j++) {                                                                   \
            vf p[NB][4];                                                                                         \
            for (int b = 0; b < NB; b++) p[b][0] = p[b][1] = p[b][2] = p[b][3] = vzero();                      \
            for (int64_t i = j * g; i < (j + 1) * g; i += 8) {                                                   \
                const uint8_t *bt = r + TILE_STEP(i);                                                            \
                PREFETCH(bt);                                                                                    \
                vi v = _mm512_loadu_si512(bt), v4 = _mm512_srli_epi32(v, 4);                                    \
                vf w0 = _mm512_permutexvar_ps(v, values), w1 = _mm512_permutexvar_ps(v4, values);               \
                vf w2 = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 8), values);                                  \
                vf w3 = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 12), values);                                 \
                vf w4 = _mm512_permutexvar_ps(HIGH_BYTE(v, 2), values), w5 = _mm512_permutexvar_ps(HIGH_BYTE(v4, 2), values); \
                vf w6 = _mm512_permutexvar_ps(HIGH_BYTE(v, 3), values), w7 = _mm512_permutexvar_ps(HIGH_BYTE(v4, 3), values); \
                for (int b = 0; b < NB; b++) {                                                                   \
                    const float *xb = x + b * in;                                                                \
                    p[b][0] = vfma(w0, vset1(xb[i]), p[b][0]);                                                   \
                    p[b][1] = vfma(w1, vset1(xb[i + 1]), p[b][1]);                                               \
                    p[b][2] = vfma(w2, vset1(xb[i + 2]), p[b][2]);                                               \
                    p[b][3] = vfma(w3, vset1(xb[i + 3]), p[b][3]);                                               \
                    p[b][0] = vfma(w4, vset1(xb[i + 4]), p[b][0]);                                               \
                    p[b][1] = vfma(w5, vset1(xb[i + 5]), p[b][1]);                                               \
                    p[b][2] = vfma(w6, vset1(xb[i + 6]), p[b][2]);                                               \
                    p[b][3] = vfma(w7, vset1(xb[i + 7]), p[b][3]);                                               \
                }                                                                                                \
            }                                                                                                    \
            for (int b = 0; b < NB; b++) {                                                                       \
                acc[b] = vfma(vload(st + j * TILE_ROWS), vadd(vadd(p[b][0], p[b][1]), vadd(p[b][2], p[b][3])), acc[b]); \
                if (mt) acc[b] = vfma(vload(mt + j * TILE_ROWS), vset1(xs[b * groups + j]), acc[b]);            \
            }                                                                                                    \
        }                                                                                                        \
        for (int b = 0; b < NB; b++) _mm_storeu_acc(y + b * out, acc[b]);                                       \
    }
#if defined(__AVX512VBMI__)
#define Q4T_LANE_BYTES                                                                                           \
    const vi lane_bytes = _mm512_mullo_epi32(                                                                    \
        _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60), _mm512_set1_epi32(0x01010101)); \
    const vi byte2 = _mm512_add_epi8(lane_bytes, _mm512_set1_epi8(2)), byte3 = _mm512_add_epi8(lane_bytes, _mm512_set1_epi8(3));
#else
#define Q4T_LANE_BYTES
#endif
Q4T_ROWS(1)
Q4T_ROWS(2)
Q4T_ROWS(3)
Q4T_ROWS(4)
#undef HIGH_BYTE
#endif

void kv_matvec_q4t_rows(const uint8_t *q, const float *s, const float *m, const float *x, float *y, int64_t out,
                        int64_t in, int64_t g, int64_t B, int nt) {
#if KV_LANES == 16
    int64_t groups = in / g, tiles = out / TILE_ROWS;
    float xs[m ? B * groups : 1];
    if (m)
        for (int64_t b = 0; b < B; b++) group_sums(x + b * in, xs + b * groups, groups, g);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const uint8_t *r = q + t * TILE_ROWS * in / 2;
        const float *st = s + t * TILE_ROWS * groups, *mt = m ? m + t * TILE_ROWS * groups : NULL;
        for (int64_t b0 = 0; b0 < B; b0 += 4) { /* four rows of x a pass over the tile (what the registers hold) */
            const float *xb = x + b0 * in, *xsb = m ? xs + b0 * groups : NULL;
            float *yb = y + b0 * out + t * TILE_ROWS;
            switch (B - b0 < 4 ? B - b0 : 4) {
            case 1: q4t_tile_rows1(r, st, mt, xb, xsb, yb, in, out, g, groups); break;
            case 2: q4t_tile_rows2(r, st, mt, xb, xsb, yb, in, out, g, groups); break;
            case 3: q4t_tile_rows3(r, st, mt, xb, xsb, yb, in, out, g, groups); break;
            default: q4t_tile_rows4(r, st, mt, xb, xsb, yb, in, out, g, groups);
            }
        }
    }
#elif KV_LANES == 8 /* AVX2: two rows of x a pass, the nibbles converted once for both (q4t_half_group's chains) */
    int64_t groups = in / g, tiles = out / TILE_ROWS;
    static const float step[8] = {1.0f, 0x1p-4f, 0x1p-8f, 0x1p-12f, 0x1p-16f, 0x1p-20f, 0x1p-24f, 1.0f};
    float *xk = malloc(sizeof(float) * (size_t)(B * in + B * groups + (m ? B * groups : 1)));
    if (!xk) {
        for (int64_t b = 0; b < B; b++) kv_matvec_q4t(q, s, m, x + b * in, y + b * out, out, in, g, nt);
        return;
    }
    float *x8 = xk + B * in, *xs = x8 + B * groups;
    for (int64_t b = 0; b < B; b++) { /* each row's inputs as kv_matvec_q4t prepares them */
        for (int64_t i = 0; i < in; i++) xk[b * in + i] = x[b * in + i] * step[i % 8];
        for (int64_t j = 0; j < groups; j++) {
            float a = 0;
            for (int64_t i = j * g; i < (j + 1) * g; i++) a += (i % 8 == 7) ? 0.0f : x[b * in + i];
            x8[b * groups + j] = 8 * a;
        }
        if (m) group_sums(x + b * in, xs + b * groups, groups, g);
    }
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const uint8_t *r = q + t * TILE_ROWS * in / 2;
        const float *st = s + t * TILE_ROWS * groups, *mt = m ? m + t * TILE_ROWS * groups : NULL;
        for (int64_t b0 = 0; b0 < B; b0 += 2) {
            const int two = B - b0 >= 2;
            vf acc[2][2] = {{vzero(), vzero()}, {vzero(), vzero()}}; /* [row of x][rows 0-7, 8-15 of the tile] */
            for (int64_t j = 0; j < groups; j++) {
                const uint8_t *bt = r + TILE_STEP(j * g);
                for (int half = 0; half < 2; half++) {
                    vf p[2];
                    q4t_half_group2(bt + 32 * half, xk + b0 * in + j * g, xk + (b0 + two) * in + j * g, g / 8, p);
                    for (int k = 0; k <= two; k++) {
                        vf pk = vsub(p[k], vset1(x8[(b0 + k) * groups + j]));
                        acc[k][half] = vfma(vload(st + j * TILE_ROWS + 8 * half), pk, acc[k][half]);
                        if (mt) acc[k][half] = vfma(vload(mt + j * TILE_ROWS + 8 * half), vset1(xs[(b0 + k) * groups + j]), acc[k][half]);
                    }
                }
            }
            for (int k = 0; k <= two; k++) {
                _mm_storeu_acc(y + (b0 + k) * out + t * TILE_ROWS, acc[k][0]);
                _mm_storeu_acc(y + (b0 + k) * out + t * TILE_ROWS + 8, acc[k][1]);
            }
        }
    }
    free(xk);
#else /* each row by the one-row product, a chunk of tiles for all rows while it is in the threads' caches */
    int64_t groups = in / g, tiles = out / TILE_ROWS;
    int64_t tile_bytes = TILE_ROWS * (in / 2 + groups * 4 * (m ? 2 : 1));
    int64_t step = KV_CHUNK_BYTES * (nt > 0 ? nt : 1) / tile_bytes;
    if (step < 1) step = 1;
    for (int64_t t0 = 0; t0 < tiles; t0 += step) {
        int64_t n = (tiles - t0 < step ? tiles - t0 : step) * TILE_ROWS, at = t0 * TILE_ROWS;
        for (int64_t b = 0; b < B; b++)
            kv_matvec_q4t(q + at * in / 2, s + at * groups, m ? m + at * groups : NULL, x + b * in, y + b * out + at, n,
                          in, g, nt);
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
