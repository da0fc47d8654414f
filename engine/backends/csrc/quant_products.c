/* One-row products of int8, int4 and int5 codes in rows, with a float32 scale per group (and an optional
 * offset: s·q + m) and float32 activations; dequantization for prefill; quantization at load. */
#include "simd.h"
#include "kernels.h"

#if KV_LANES
/* One group's codes . x, inputs i..end: four chains of FMAs where the group is long enough (their latency,
 * not memory, bounds a long row of int8 codes), two for a group of 32 (a GGUF's Q8_0). AVX2 takes groups of
 * whole 32s another way (q8_bytes32, q8_bytes_group). */
static inline vf q8_group(const int8_t *r, const float *x, int64_t i, int64_t end) {
    vf p = vzero(), p1 = vzero();
    if (i + 4 * KV_LANES <= end) {
        vf p2 = vzero(), p3 = vzero();
        for (; i + 4 * KV_LANES <= end; i += 4 * KV_LANES) {
            PREFETCH(r + i);
            p = vfma(vload_i8(r + i), vload(x + i), p);
            p1 = vfma(vload_i8(r + i + KV_LANES), vload(x + i + KV_LANES), p1);
            p2 = vfma(vload_i8(r + i + 2 * KV_LANES), vload(x + i + 2 * KV_LANES), p2);
            p3 = vfma(vload_i8(r + i + 3 * KV_LANES), vload(x + i + 3 * KV_LANES), p3);
        }
        p = vadd(p, p2);
        p1 = vadd(p1, p3);
    }
    for (; i + 2 * KV_LANES <= end; i += 2 * KV_LANES) {
        PREFETCH(r + i);
        p = vfma(vload_i8(r + i), vload(x + i), p);
        p1 = vfma(vload_i8(r + i + KV_LANES), vload(x + i + KV_LANES), p1);
    }
    for (; i < end; i += KV_LANES) p = vfma(vload_i8(r + i), vload(x + i), p);
    return vadd(p, p1);
}
#if KV_LANES == 8
/* AVX2, 32 codes a load: byte k of each 4-byte lane (input 4j+k of the 32) is moved to the lane's top byte by
 * vpshufb (the rest zeroed), byte 3 masked where it lies, so that each lane reads as the code times 2^24 — exact in
 * a float, signed with no offset — and meets x[4j+k] (xp: x rearranged once a call); the 2^-24 comes off once a row.
 * A code costs a shuffle (or mask), a conversion and an FMA: no vpmovsxbd, three vector-pipe cycles in LLVM's model
 * of AMD's Zen 3 (engine/BENCHMARKS.md, "int8 bytes in place"). Here: the 32 codes at r as 4 vectors, byte
 * position k in c[k]. */
static inline void q8_bytes_values(const int8_t *r, vf c[4]) {
#define TOP(k) _mm256_setr_epi8(-1, -1, -1, k, -1, -1, -1, 4 + k, -1, -1, -1, 8 + k, -1, -1, -1, 12 + k, \
                                -1, -1, -1, k, -1, -1, -1, 4 + k, -1, -1, -1, 8 + k, -1, -1, -1, 12 + k)
    vi v = _mm256_loadu_si256((const __m256i *)r);
    c[0] = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(v, TOP(0)));
    c[1] = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(v, TOP(1)));
    c[2] = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(v, TOP(2)));
    c[3] = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFF000000u)));
#undef TOP
}

/* 32 codes . xp into four chains, one a byte position. */
static inline void q8_bytes(const int8_t *r, const float *xp, vf *a0, vf *a1, vf *a2, vf *a3) {
    vf c[4];
    q8_bytes_values(r, c);
    *a0 = vfma(c[0], vload(xp), *a0), *a1 = vfma(c[1], vload(xp + 8), *a1);
    *a2 = vfma(c[2], vload(xp + 16), *a2), *a3 = vfma(c[3], vload(xp + 24), *a3);
}

/* x [in] -> xp [in], each 32 inputs as q8_bytes reads them: [byte k][lane j] = x[4j+k]. */
static void q8_bytes_x(const float *x, float *xp, int64_t in) {
    for (int64_t i = 0; i < in; i += 32)
        for (int64_t k = 0; k < 4; k++)
            for (int64_t j = 0; j < 8; j++) xp[i + 8 * k + j] = x[i + 4 * j + k];
}

/* A group of 32 (a GGUF's Q8_0, kvchat's int8 head) . xp, one chain: the groups are the chains. The lanes' sum is
 * 2^24 times the group's product. */
static inline vf q8_bytes32(const int8_t *r, const float *xp) {
    vf c[4];
    PREFETCH(r);
    q8_bytes_values(r, c);
    return vfma(c[3], vload(xp + 24), vfma(c[2], vload(xp + 16), vfma(c[1], vload(xp + 8), vmul(c[0], vload(xp)))));
}

/* A longer group's codes (inputs i..end, whole 32s) . xp, eight chains; the lanes' sum is 2^24 times theirs. */
static inline vf q8_bytes_group(const int8_t *r, const float *xp, int64_t i, int64_t end) {
    vf a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
    if (i + 64 <= end) {
        vf a4 = vzero(), a5 = vzero(), a6 = vzero(), a7 = vzero();
        for (; i + 64 <= end; i += 64) {
            PREFETCH(r + i);
            q8_bytes(r + i, xp + i, &a0, &a1, &a2, &a3);
            q8_bytes(r + i + 32, xp + i + 32, &a4, &a5, &a6, &a7);
        }
        a0 = vadd(a0, a4), a1 = vadd(a1, a5), a2 = vadd(a2, a6), a3 = vadd(a3, a7);
    }
    if (i < end) {
        PREFETCH(r + i);
        q8_bytes(r + i, xp + i, &a0, &a1, &a2, &a3);
    }
    return vadd(vadd(a0, a1), vadd(a2, a3));
}
#endif
/* Two vectors' codes . x from input i: one product, then one FMA onto it. */
static inline vf q8_pair(const int8_t *r, const float *x, int64_t i) {
    PREFETCH(r + i);
    return vfma(vload_i8(r + i), vload(x + i), vmul(vload_i8(r + i + KV_LANES), vload(x + i + KV_LANES)));
}
#endif

/* int8 codes q [out, in], scales s [out, in/g]: y[o] = sum_j s[o, j] * (q[o, group j] . x[group j]) (+ the offsets'). */
void kv_matvec_q8(const int8_t *q, const float *s, const float *m, const float *x, float *y, int64_t out, int64_t in,
                  int64_t g, int nt) {
    int64_t groups = in / g;
    float xs[groups];
    if (m) group_sums(x, xs, groups, g);
#if KV_LANES == 8
    float xp[g % 32 == 0 ? in : 1];
    if (g % 32 == 0) q8_bytes_x(x, xp, in);
#endif
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t o = 0; o < out; o++) {
        const int8_t *r = q + o * in;
        const float *so = s + o * groups;
        float a = 0;
#if KV_LANES
        if (g == 2 * KV_LANES) { /* short groups (a GGUF's Q8_0, kvchat's int8 head): two a turn, two chains */
            vf acc0 = vzero(), acc1 = vzero();
            int64_t j = 0;
            for (; j + 2 <= groups; j += 2) {
                acc0 = vfma(vset1(so[j]), q8_pair(r, x, j * g), acc0);
                acc1 = vfma(vset1(so[j + 1]), q8_pair(r, x, (j + 1) * g), acc1);
            }
            if (j < groups) acc0 = vfma(vset1(so[j]), q8_pair(r, x, j * g), acc0);
            a = vsum(vadd(acc0, acc1));
#if KV_LANES == 8
        } else if (g == 32) { /* AVX2, groups of 32, bytes in place: four groups a turn, a chain each */
            vf acc0 = vzero(), acc1 = vzero(), acc2 = vzero(), acc3 = vzero();
            int64_t j = 0;
            for (; j + 4 <= groups; j += 4) {
                acc0 = vfma(vset1(so[j]), q8_bytes32(r + j * 32, xp + j * 32), acc0);
                acc1 = vfma(vset1(so[j + 1]), q8_bytes32(r + j * 32 + 32, xp + j * 32 + 32), acc1);
                acc2 = vfma(vset1(so[j + 2]), q8_bytes32(r + j * 32 + 64, xp + j * 32 + 64), acc2);
                acc3 = vfma(vset1(so[j + 3]), q8_bytes32(r + j * 32 + 96, xp + j * 32 + 96), acc3);
            }
            for (; j < groups; j++) acc0 = vfma(vset1(so[j]), q8_bytes32(r + j * 32, xp + j * 32), acc0);
            a = vsum(vadd(vadd(acc0, acc1), vadd(acc2, acc3))) * 0x1p-24f;
        } else if (g % 32 == 0) { /* AVX2, longer groups of whole 32s, bytes in place */
            vf acc = vzero();
            for (int64_t j = 0; j < groups; j++)
                acc = vfma(vset1(so[j]), q8_bytes_group(r, xp, j * g, (j + 1) * g), acc);
            a = vsum(acc) * 0x1p-24f;
#endif
        } else if (g % KV_LANES == 0) {
            vf acc = vzero();
            for (int64_t j = 0; j < groups; j++) acc = vfma(vset1(so[j]), q8_group(r, x, j * g, (j + 1) * g), acc);
            a = vsum(acc);
        } else
#endif
            for (int64_t j = 0; j < groups; j++) a += so[j] * dot_i8(r + j * g, x + j * g, g);
        y[o] = m ? a + dot_f32(m + o * groups, xs, groups) : a;
    }
}
/* int8 codes for several rows of x at once (x [B, in], y [B, out]): with 16-lane vectors a row's codes are converted
 * once for up to four rows of x, each row's chains as kv_matvec_q8 keeps them (bit for bit its one-row product);
 * elsewhere each row runs kv_matvec_q8 a chunk of rows at a time. */
#if KV_LANES == 16
#define Q8_ROWS(NB)                                                                                              \
    static void q8_row_pairs##NB(const int8_t *r, const float *so, const float *x, float *a, int64_t in,        \
                                 int64_t groups) {                                                               \
        vf acc0[NB], acc1[NB];                                                                                   \
        for (int b = 0; b < NB; b++) acc0[b] = acc1[b] = vzero();                                               \
        int64_t j = 0;                                                                                           \
        for (; j + 2 <= groups; j += 2) {                                                                        \
            const int64_t i = j * 32, k = i + 32;                                                                \
            PREFETCH(r + i);                                                                                     \
            vf w0 = vload_i8(r + i), w1 = vload_i8(r + i + 16);                                                  \
            PREFETCH(r + k);                                                                                     \
            vf w2 = vload_i8(r + k), w3 = vload_i8(r + k + 16);                                                  \
            for (int b = 0; b < NB; b++) {                                                                       \
                const float *xb = x + b * in;                                                                    \
                acc0[b] = vfma(vset1(so[j]), vfma(w0, vload(xb + i), vmul(w1, vload(xb + i + 16))), acc0[b]);     \
                acc1[b] = vfma(vset1(so[j + 1]), vfma(w2, vload(xb + k), vmul(w3, vload(xb + k + 16))), acc1[b]); \
            }                                                                                                    \
        }                                                                                                        \
        if (j < groups) {                                                                                        \
            const int64_t i = j * 32;                                                                            \
            PREFETCH(r + i);                                                                                     \
            vf w0 = vload_i8(r + i), w1 = vload_i8(r + i + 16);                                                  \
            for (int b = 0; b < NB; b++) {                                                                       \
                const float *xb = x + b * in;                                                                    \
                acc0[b] = vfma(vset1(so[j]), vfma(w0, vload(xb + i), vmul(w1, vload(xb + i + 16))), acc0[b]);     \
            }                                                                                                    \
        }                                                                                                        \
        for (int b = 0; b < NB; b++) a[b] = vsum(vadd(acc0[b], acc1[b]));                                        \
    }
Q8_ROWS(1)
Q8_ROWS(2)
Q8_ROWS(3)
Q8_ROWS(4)
/* Longer groups (whole vectors): q8_group's chains for each row of x, the codes converted once for all. */
#define Q8G_ROWS(NB)                                                                                             \
    static void q8_row_groups##NB(const int8_t *r, const float *so, const float *x, float *a, int64_t in,       \
                                  int64_t groups, int64_t g) {                                                   \
        vf acc[NB];                                                                                              \
        for (int b = 0; b < NB; b++) acc[b] = vzero();                                                          \
        for (int64_t j = 0; j < groups; j++) {                                                                   \
            int64_t i = j * g, end = i + g;                                                                      \
            vf p[NB][4];                                                                                         \
            for (int b = 0; b < NB; b++) p[b][0] = p[b][1] = vzero();                                           \
            if (i + 4 * KV_LANES <= end) {                                                                       \
                for (int b = 0; b < NB; b++) p[b][2] = p[b][3] = vzero();                                       \
                for (; i + 4 * KV_LANES <= end; i += 4 * KV_LANES) {                                             \
                    PREFETCH(r + i);                                                                             \
                    vf w0 = vload_i8(r + i), w1 = vload_i8(r + i + KV_LANES);                                    \
                    vf w2 = vload_i8(r + i + 2 * KV_LANES), w3 = vload_i8(r + i + 3 * KV_LANES);                 \
                    for (int b = 0; b < NB; b++) {                                                               \
                        const float *xb = x + b * in;                                                            \
                        p[b][0] = vfma(w0, vload(xb + i), p[b][0]);                                              \
                        p[b][1] = vfma(w1, vload(xb + i + KV_LANES), p[b][1]);                                   \
                        p[b][2] = vfma(w2, vload(xb + i + 2 * KV_LANES), p[b][2]);                               \
                        p[b][3] = vfma(w3, vload(xb + i + 3 * KV_LANES), p[b][3]);                               \
                    }                                                                                            \
                }                                                                                                \
                for (int b = 0; b < NB; b++) p[b][0] = vadd(p[b][0], p[b][2]), p[b][1] = vadd(p[b][1], p[b][3]); \
            }                                                                                                    \
            for (; i + 2 * KV_LANES <= end; i += 2 * KV_LANES) {                                                 \
                PREFETCH(r + i);                                                                                 \
                vf w0 = vload_i8(r + i), w1 = vload_i8(r + i + KV_LANES);                                        \
                for (int b = 0; b < NB; b++) {                                                                   \
                    p[b][0] = vfma(w0, vload(x + b * in + i), p[b][0]);                                          \
                    p[b][1] = vfma(w1, vload(x + b * in + i + KV_LANES), p[b][1]);                               \
                }                                                                                                \
            }                                                                                                    \
            for (; i < end; i += KV_LANES) {                                                                     \
                vf w0 = vload_i8(r + i);                                                                         \
                for (int b = 0; b < NB; b++) p[b][0] = vfma(w0, vload(x + b * in + i), p[b][0]);                 \
            }                                                                                                    \
            for (int b = 0; b < NB; b++) acc[b] = vfma(vset1(so[j]), vadd(p[b][0], p[b][1]), acc[b]);           \
        }                                                                                                        \
        for (int b = 0; b < NB; b++) a[b] = vsum(acc[b]);                                                       \
    }
Q8G_ROWS(1)
Q8G_ROWS(2)
Q8G_ROWS(3)
Q8G_ROWS(4)
#endif

void kv_matvec_q8_rows(const int8_t *q, const float *s, const float *m, const float *x, float *y, int64_t out,
                       int64_t in, int64_t g, int64_t B, int nt) {
#if KV_LANES == 16
    if (g % KV_LANES == 0) { /* the one-row product's paths for 16 lanes: pairs of groups of 32, longer groups */
        int64_t groups = in / g;
        float xs[m ? B * groups : 1];
        if (m)
            for (int64_t b = 0; b < B; b++) group_sums(x + b * in, xs + b * groups, groups, g);
#pragma omp parallel for num_threads(nt) schedule(static)
        for (int64_t o = 0; o < out; o++) {
            const int8_t *r = q + o * in;
            const float *so = s + o * groups;
            for (int64_t b0 = 0; b0 < B; b0 += 4) {
                float a[4];
                const float *xb = x + b0 * in;
                int64_t nb = B - b0 < 4 ? B - b0 : 4;
                if (g == 2 * KV_LANES) switch (nb) {
                    case 1: q8_row_pairs1(r, so, xb, a, in, groups); break;
                    case 2: q8_row_pairs2(r, so, xb, a, in, groups); break;
                    case 3: q8_row_pairs3(r, so, xb, a, in, groups); break;
                    default: q8_row_pairs4(r, so, xb, a, in, groups);
                    }
                else switch (nb) {
                    case 1: q8_row_groups1(r, so, xb, a, in, groups, g); break;
                    case 2: q8_row_groups2(r, so, xb, a, in, groups, g); break;
                    case 3: q8_row_groups3(r, so, xb, a, in, groups, g); break;
                    default: q8_row_groups4(r, so, xb, a, in, groups, g);
                    }
                for (int64_t b = 0; b < nb; b++)
                    y[(b0 + b) * out + o] = m ? a[b] + dot_f32(m + o * groups, xs + (b0 + b) * groups, groups) : a[b];
            }
        }
        return;
    }
#endif
    /* each row by the one-row product, a chunk of rows for all rows while it is in the threads' caches */
    int64_t groups = in / g, row_bytes = in + groups * 4 * (m ? 2 : 1);
    int64_t step = KV_CHUNK_BYTES * (nt > 0 ? nt : 1) / row_bytes;
    if (step < 1) step = 1;
    for (int64_t o0 = 0; o0 < out; o0 += step) {
        int64_t n = out - o0 < step ? out - o0 : step;
        for (int64_t b = 0; b < B; b++)
            kv_matvec_q8(q + o0 * in, s + o0 * groups, m ? m + o0 * groups : NULL, x + b * in, y + b * out + o0, n, in,
                         g, nt);
    }
}

#if KV_LANES == 16
/* 32 inputs of an int4 row (16 bytes of codes) against x's even and odd entries: each nibble becomes its weight
 * through `table` (vpermps reads index bits 0-3), low nibbles into *a, high ones into *b. */
static inline void q4_step(const uint8_t *r, const float *xe, const float *xo, int64_t i, vf table, vf *a, vf *b) {
    PREFETCH(r + i);
    vi c = vload_u8_i32(r + i);
    *a = vfma(_mm512_permutexvar_ps(c, table), vload(xe + i), *a);
    *b = vfma(_mm512_permutexvar_ps(vi_shr4(c), table), vload(xo + i), *b);
}
#endif

/* int4 codes two a byte [out, in/2] (value 2k in the low nibble, 2k+1 in the high one, 4-bit two's
 * complement), scales and offsets as for int8. x is split into its even and odd entries once, so that a
 * byte's two nibbles meet their inputs lane by lane. */
void kv_matvec_q4(const uint8_t *q, const float *s, const float *m, const float *x, float *y, int64_t out, int64_t in,
                  int64_t g, int nt) {
    int64_t groups = in / g, half = in / 2, hg = g / 2;
    float xe[half], xo[half], xs[groups];
    for (int64_t i = 0; i < half; i++) {
        xe[i] = x[2 * i];
        xo[i] = x[2 * i + 1];
    }
    if (m) group_sums(x, xs, groups, g);
#if KV_LANES == 16
    const vf values = int4_values();
#endif
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t o = 0; o < out; o++) {
        const uint8_t *r = q + o * half;
        const float *so = s + o * groups;
        float a = 0;
#if KV_LANES == 16
        if (hg % KV_LANES == 0) { /* a nibble becomes its dequantized weight s·q by a 16-entry table */
            vf a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero(); /* two steps a turn: four FMA chains */
            if (hg == KV_LANES) { /* groups of 32 (a GGUF's blocks): two groups a turn */
                int64_t j = 0;
                for (; j + 2 <= groups; j += 2) {
                    q4_step(r, xe, xo, j * hg, vmul(vset1(so[j]), values), &a0, &a1);
                    q4_step(r, xe, xo, (j + 1) * hg, vmul(vset1(so[j + 1]), values), &a2, &a3);
                }
                if (j < groups) q4_step(r, xe, xo, j * hg, vmul(vset1(so[j]), values), &a0, &a1);
            } else
                for (int64_t j = 0; j < groups; j++) {
                    vf table = vmul(vset1(so[j]), values);
                    int64_t i = j * hg, end = i + hg;
                    for (; i + 2 * KV_LANES <= end; i += 2 * KV_LANES) {
                        q4_step(r, xe, xo, i, table, &a0, &a1);
                        q4_step(r, xe, xo, i + KV_LANES, table, &a2, &a3);
                    }
                    if (i < end) q4_step(r, xe, xo, i, table, &a0, &a1);
                }
            a = vsum(vadd(vadd(a0, a1), vadd(a2, a3)));
        } else
#elif KV_LANES
        if (hg % KV_LANES == 0) {
            vf acc = vzero();
            for (int64_t j = 0; j < groups; j++) {
                vf p = vzero();
                for (int64_t i = j * hg; i < (j + 1) * hg; i += KV_LANES) {
                    PREFETCH(r + i);
                    vi b = vload_u8_i32(r + i);
                    p = vfma(vi_float(vi_sext4(vi_and(b, 15))), vload(xe + i), p);
                    p = vfma(vi_float(vi_sext4(vi_shr4(b))), vload(xo + i), p);
                }
                acc = vfma(vset1(so[j]), p, acc);
            }
            a = vsum(acc);
        } else
#endif
            for (int64_t j = 0; j < groups; j++) {
                float p = 0;
                for (int64_t i = j * hg; i < (j + 1) * hg; i++) {
                    int lo = int4_value(r[i]), hi = int4_value(r[i] >> 4);
                    p += (float)lo * xe[i] + (float)hi * xo[i];
                }
                a += so[j] * p;
            }
        y[o] = m ? a + dot_f32(m + o * groups, xs, groups) : a;
    }
}

void kv_matvec_q5(const uint8_t *q, const float *s, const float *m, const float *x, float *y, int64_t out, int64_t in,
                  int64_t g, int nt) {
    int64_t groups = in / Q5_GROUP;
    float xs[groups];
    if (m) group_sums(x, xs, groups, Q5_GROUP);
#if KV_LANES == 16
    const vf lo_values = _mm512_setr_ps(-16, -15, -14, -13, -12, -11, -10, -9, -8, -7, -6, -5, -4, -3, -2, -1);
    const vf hi_values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#endif
    (void)g;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t o = 0; o < out; o++) {
        const uint8_t *r = q + o * groups * Q5_BYTES;
        const float *so = s + o * groups;
        float a = 0;
#if KV_LANES == 16
        /* a code becomes its weight s·(q - 16) by a 32-entry table in two registers (one permute a 16) */
        vf a0 = vzero(), a1 = vzero();
        for (int64_t j = 0; j < groups; j++) {
            const uint8_t *b = r + j * Q5_BYTES;
            PREFETCH(b);
            uint32_t qh;
            memcpy(&qh, b, 4);
            vf sc = vset1(so[j]), t0 = vmul(sc, lo_values), t1 = vmul(sc, hi_values);
            vi n = vload_u8_i32(b + 4);
            vi lo = _mm512_mask_add_epi32(vi_and(n, 15), (__mmask16)(qh & 0xFFFF), vi_and(n, 15), _mm512_set1_epi32(16));
            vi hi = _mm512_mask_add_epi32(vi_shr4(n), (__mmask16)(qh >> 16), vi_shr4(n), _mm512_set1_epi32(16));
            a0 = vfma(_mm512_permutex2var_ps(t0, lo, t1), vload(x + j * Q5_GROUP), a0);
            a1 = vfma(_mm512_permutex2var_ps(t0, hi, t1), vload(x + j * Q5_GROUP + 16), a1);
        }
        a = vsum(vadd(a0, a1));
#elif KV_LANES == 8
        const __m256i bit = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        vf acc = vzero();
        for (int64_t j = 0; j < groups; j++) {
            const uint8_t *b = r + j * Q5_BYTES;
            uint32_t qh;
            memcpy(&qh, b, 4);
            vf p = vzero();
            for (int h = 0; h < 2; h++) { /* inputs 8h..8h+7 (low nibbles) and 16+8h.. (high nibbles) */
                vi n = vload_u8_i32(b + 4 + 8 * h);
                vi fl = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)(qh >> (8 * h))), bit), _mm256_set1_epi32(1));
                vi fh = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)(qh >> (16 + 8 * h))), bit), _mm256_set1_epi32(1));
                vi ql = _mm256_sub_epi32(_mm256_or_si256(vi_and(n, 15), _mm256_slli_epi32(fl, 4)), _mm256_set1_epi32(16));
                vi qhv = _mm256_sub_epi32(_mm256_or_si256(vi_shr4(n), _mm256_slli_epi32(fh, 4)), _mm256_set1_epi32(16));
                p = vfma(vi_float(ql), vload(x + j * Q5_GROUP + 8 * h), p);
                p = vfma(vi_float(qhv), vload(x + j * Q5_GROUP + 16 + 8 * h), p);
            }
            acc = vfma(vset1(so[j]), p, acc);
        }
        a = vsum(acc);
#else
        for (int64_t j = 0; j < groups; j++) {
            int c[32];
            q5_group(r + j * Q5_BYTES, c);
            float p = 0;
            for (int i = 0; i < 32; i++) p += (float)(c[i] - 16) * x[j * Q5_GROUP + i];
            a += so[j] * p;
        }
#endif
        y[o] = m ? a + dot_f32(m + o * groups, xs, groups) : a;
    }
}

void kv_dequant_q5(const uint8_t *q, const float *s, const float *m, float *w, int64_t out, int64_t in, int64_t g,
                   int nt) {
    int64_t groups = in / Q5_GROUP;
    (void)g;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t o = 0; o < out; o++)
        for (int64_t j = 0; j < groups; j++) {
            int c[32];
            q5_group(q + (o * groups + j) * Q5_BYTES, c);
            float sc = s[o * groups + j], mn = m ? m[o * groups + j] : 0.0f;
            float *d = w + o * in + j * Q5_GROUP;
            for (int i = 0; i < 32; i++) d[i] = sc * (float)(c[i] - 16) + mn;
        }
}

/* ---- Dequantization for many-row products (prefill): x̂ = s · q, float32 [out, in], one pass ---- */
void kv_dequant_q8(const int8_t *q, const float *s, const float *m, float *w, int64_t out, int64_t in, int64_t g,
                   int nt) {
    int64_t groups = in / g;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t o = 0; o < out; o++)
        for (int64_t j = 0; j < groups; j++) {
            float sc = s[o * groups + j], mn = m ? m[o * groups + j] : 0.0f;
            const int8_t *r = q + o * in + j * g;
            float *d = w + o * in + j * g;
            for (int64_t i = 0; i < g; i++) d[i] = sc * (float)r[i] + mn;
        }
}

void kv_dequant_q4(const uint8_t *q, const float *s, const float *m, float *w, int64_t out, int64_t in, int64_t g,
                   int nt) {
    int64_t groups = in / g, half = in / 2;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t o = 0; o < out; o++)
        for (int64_t j = 0; j < groups; j++) {
            float sc = s[o * groups + j], mn = m ? m[o * groups + j] : 0.0f;
            const uint8_t *r = q + o * half + j * g / 2;
            float *d = w + o * in + j * g;
            for (int64_t i = 0; i < g / 2; i++) {
                d[2 * i] = sc * (float)int4_value(r[i]) + mn;
                d[2 * i + 1] = sc * (float)int4_value(r[i] >> 4) + mn;
            }
        }
}

/* ---- Quantization at load: s = max|x| / Q per group (1 for an all-zero group), q = clip(round_half_even(x / s)),
 * the arithmetic of engine/quant.py in one pass. int4 codes are stored two a byte, low nibble first. ---- */
void kv_quantize(const float *w, int8_t *codes, uint8_t *packed, float *s, int64_t out, int64_t in, int64_t g,
                 int qmax, int nt) {
    int64_t groups = in / g;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t o = 0; o < out; o++)
        for (int64_t j = 0; j < groups; j++) {
            const float *x = w + o * in + j * g;
            float m = 0;
            for (int64_t i = 0; i < g; i++) m = fmaxf(m, fabsf(x[i]));
            float sc = m / (float)qmax;
            if (sc == 0) sc = 1;
            s[o * groups + j] = sc;
            for (int64_t i = 0; i < g; i++) {
                float c = nearbyintf(x[i] / sc); /* the default rounding mode: half to even, as torch.round */
                c = c > qmax ? qmax : (c < -qmax ? -qmax : c);
                if (codes) codes[o * in + j * g + i] = (int8_t)c;
                else {
                    uint8_t nib = (uint8_t)((int8_t)c) & 15;
                    int64_t at = (o * in + j * g + i) / 2;
                    packed[at] = (i & 1) ? (uint8_t)(packed[at] | (nib << 4)) : nib;
                }
            }
        }
}
