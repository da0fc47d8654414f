/* One-row products for decode on the CPU: y = W x with W in its checkpoint layout [out, in].
 *
 * Batch-1 decode reads every weight once per token, so its speed is the speed at which these loops
 * stream W from memory. Each output row is one contiguous dot product (the access pattern memory
 * prefetchers like best), rows are split across the threads torch uses (OpenMP: the process's one
 * libgomp, which torch has already loaded), and accumulation is in float32 whatever W's type.
 * Built by engine/kernels.py with the system compiler for this CPU (-O3 -march=native), loaded with
 * ctypes; every function is checked against torch before the engine uses it.
 *
 * Layouts: float32, bfloat16 and float16 rows; int8 codes [out, in] and int4 codes two a byte, low
 * nibble first [out, in/2], with one float32 scale per group of g inputs [out, in/g] (engine/quant.py).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
static inline float kv_hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

#if defined(__AVX512F__)
#include <immintrin.h>
#define KV_LANES 16
typedef __m512 vf;
typedef __m512i vi;
#define vzero() _mm512_setzero_ps()
#define vset1(s) _mm512_set1_ps(s)
#define vload(p) _mm512_loadu_ps(p)
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vadd(a, b) _mm512_add_ps(a, b)
#define vmul(a, b) _mm512_mul_ps(a, b)
#define VDIV(a, b) _mm512_div_ps(a, b)
#define _mm_storeu_acc(p, v) _mm512_storeu_ps(p, v)
#define vsum(v) _mm512_reduce_add_ps(v)
#define vload_f16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define vload_bf16(p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#define vload_i8(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define vload_u8_i32(p) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define vi_and(a, m) _mm512_and_si512(a, _mm512_set1_epi32(m))
#define vi_shr4(a) _mm512_srli_epi32(a, 4)
#define vi_sext4(a) _mm512_sub_epi32(_mm512_xor_si512(a, _mm512_set1_epi32(8)), _mm512_set1_epi32(8))
#define vi_float(a) _mm512_cvtepi32_ps(a)
#define KV_ISA "avx512"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KV_LANES 8
typedef __m256 vf;
typedef __m256i vi;
#define vzero() _mm256_setzero_ps()
#define vset1(s) _mm256_set1_ps(s)
#define vload(p) _mm256_loadu_ps(p)
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vadd(a, b) _mm256_add_ps(a, b)
#define vmul(a, b) _mm256_mul_ps(a, b)
#define VDIV(a, b) _mm256_div_ps(a, b)
#define _mm_storeu_acc(p, v) _mm256_storeu_ps(p, v)
#define vsum(v) kv_hsum256(v)
#define vload_f16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define vload_bf16(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define vload_i8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define vload_u8_i32(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define vi_and(a, m) _mm256_and_si256(a, _mm256_set1_epi32(m))
#define vi_shr4(a) _mm256_srli_epi32(a, 4)
#define vi_sext4(a) _mm256_sub_epi32(_mm256_xor_si256(a, _mm256_set1_epi32(8)), _mm256_set1_epi32(8))
#define vi_float(a) _mm256_cvtepi32_ps(a)
#define KV_ISA "avx2"
#else
#define KV_LANES 0
#define KV_ISA "generic"
#endif

const char *kv_isa(void) { return KV_ISA; }

/* Weights stream from memory ahead of what the hardware prefetcher reaches (it stops at each 4 KiB page):
 * each 64 bytes a loop reads asks for the line PREFETCH_AHEAD bytes further on, into L2 (locality 2:
 * prefetcht1), where the loads find it without the lines ahead crowding L1. */
#define PREFETCH_AHEAD 4096
#define PREFETCH(p) __builtin_prefetch((const char *)(p) + PREFETCH_AHEAD, 0, 2)

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Row dot products. Two vector accumulators hide the FMA latency; the tail runs scalar. */
#define ROW_DOT(NAME, WT, LOADW, SCALARW)                                          \
    static inline float NAME(const WT *restrict r, const float *restrict x, int64_t in) { \
        int64_t i = 0;                                                             \
        float a = 0;                                                               \
        ROW_DOT_SIMD(LOADW)                                                        \
        for (; i < in; i++) a += SCALARW(r[i]) * x[i];                             \
        return a;                                                                  \
    }

#if KV_LANES
#define ROW_DOT_SIMD(LOADW)                                                        \
    vf a0 = vzero(), a1 = vzero();                                                 \
    for (; i + 2 * KV_LANES <= in; i += 2 * KV_LANES) {                            \
        PREFETCH(r + i);                                                           \
        if (sizeof(*r) * 2 * KV_LANES > 64) PREFETCH((const char *)(r + i) + 64);  \
        a0 = vfma(LOADW(r + i), vload(x + i), a0);                                 \
        a1 = vfma(LOADW(r + i + KV_LANES), vload(x + i + KV_LANES), a1);           \
    }                                                                              \
    a = vsum(vadd(a0, a1));
#else
#define ROW_DOT_SIMD(LOADW)
#endif

/* acc = acc * c + p * v over d entries: the running sum of an online softmax. */
#define ROW_AXPY(NAME, WT, LOADW, SCALARW)                                          \
    static inline void NAME(float *restrict acc, float c, float p, const WT *restrict v, int64_t d) { \
        int64_t i = 0;                                                              \
        ROW_AXPY_SIMD(LOADW)                                                        \
        for (; i < d; i++) acc[i] = acc[i] * c + p * SCALARW(v[i]);                 \
    }
#if KV_LANES
#define ROW_AXPY_SIMD(LOADW)                                                        \
    for (; i + KV_LANES <= d; i += KV_LANES) {                                      \
        PREFETCH(v + i);                                                            \
        _mm_storeu_acc(acc + i, vfma(vset1(p), LOADW(v + i), vmul(vload(acc + i), vset1(c)))); \
    }
#else
#define ROW_AXPY_SIMD(LOADW)
#endif

/* e^x, n vectors at a time: x = k·ln2 + r with |r| <= ln2/2, e^r by its Taylor polynomial to r^7 (relative
 * error below 2^-23), times 2^k; below -87.3 the result is 0 (float32's e^x is subnormal or 0 there). */
#if KV_LANES
#if KV_LANES == 16
#define vround(x) _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#else
#define vround(x) _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#endif
static inline vf exp_of_remainder(vf x, vf k) { /* e^r, r = x - k·ln2 (ln2 in two parts) */
    vf r = vfma(k, vset1(-0.693145752f), x);
    r = vfma(k, vset1(-1.42860677e-06f), r);
    vf p = vset1(1.0f / 5040);
    const float c[] = {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};
    for (int i = 0; i < 7; i++) p = vfma(p, r, vset1(c[i]));
    return p;
}
static inline vf vexp(vf x) {
#if KV_LANES == 16
    vf k = vround(vmul(x, vset1(1.44269504f)));
    vf e = _mm512_scalef_ps(exp_of_remainder(x, k), k);
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, vset1(-87.3f), _CMP_GE_OQ), e);
#else
    vf xc = _mm256_max_ps(x, vset1(-87.3f)), k = vround(vmul(xc, vset1(1.44269504f)));
    __m256i k2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    vf e = vmul(exp_of_remainder(xc, k), _mm256_castsi256_ps(k2)); /* k >= -126 here: 2^k is a normal float */
    return _mm256_and_ps(e, _mm256_cmp_ps(x, vset1(-87.3f), _CMP_GT_OQ));
#endif
}
#endif

/* y[i] = e^(x[i] - shift) over n values, in place allowed. */
static inline void exp_shifted(const float *x, float *y, int64_t n, float shift) {
    int64_t i = 0;
#if KV_LANES
    for (; i + KV_LANES <= n; i += KV_LANES) _mm_storeu_acc(y + i, vexp(vadd(vload(x + i), vset1(-shift))));
#endif
    for (; i < n; i++) y[i] = expf(x[i] - shift);
}

/* silu(g) = g / (1 + e^-g) over n values, in place allowed. */
static inline void silu_f32(const float *g, float *y, int64_t n) {
    int64_t i = 0;
#if KV_LANES
    for (; i + KV_LANES <= n; i += KV_LANES) {
        vf v = vload(g + i);
        _mm_storeu_acc(y + i, VDIV(v, vadd(vset1(1.0f), vexp(vmul(v, vset1(-1.0f))))));
    }
#endif
    for (; i < n; i++) y[i] = g[i] / (1.0f + expf(-g[i]));
}

#define AS_FLOAT(v) ((float)(v))
ROW_DOT(dot_f32, float, vload, AS_FLOAT)
ROW_DOT(dot_bf16, uint16_t, vload_bf16, bf16_to_f32)
ROW_DOT(dot_i8, int8_t, vload_i8, AS_FLOAT)
ROW_AXPY(axpy_f32, float, vload, AS_FLOAT)
ROW_AXPY(axpy_bf16, uint16_t, vload_bf16, bf16_to_f32)
#ifdef __FLT16_MAX__ /* compilers without _Float16 build the others */
ROW_DOT(dot_f16, _Float16, vload_f16, AS_FLOAT)
ROW_AXPY(axpy_f16, _Float16, vload_f16, AS_FLOAT)
#endif

/* y [out] = W [out, in] x [in]; x and y in W's type (x is widened to float32 once). */
void kv_matvec_f32(const float *w, const float *x, float *y, int64_t out, int64_t in, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t o = 0; o < out; o++) y[o] = dot_f32(w + o * in, x, in);
}

#if KV_LANES == 16 && defined(__AVX512BF16__)
/* A bfloat16 row . bfloat16 x: vdpbf16ps multiplies 32 pairs (exact in float32) and adds each two into a lane. */
static inline float dot_bf16_bf16(const uint16_t *restrict r, const uint16_t *restrict xh, const float *restrict x,
                                  int64_t in) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 64 <= in; i += 64) {
        PREFETCH(r + i);
        PREFETCH(r + i + 32);
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(r + i), (__m512bh)_mm512_loadu_si512(xh + i));
        a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(r + i + 32), (__m512bh)_mm512_loadu_si512(xh + i + 32));
    }
    float a = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    return a + dot_bf16(r + i, x + i, in - i);
}
#endif

void kv_matvec_bf16(const uint16_t *w, const uint16_t *xh, uint16_t *y, int64_t out, int64_t in, int nt) {
    float x[in];
    for (int64_t i = 0; i < in; i++) x[i] = bf16_to_f32(xh[i]);
#pragma omp parallel for num_threads(nt) schedule(static)
#if KV_LANES == 16 && defined(__AVX512BF16__)
    for (int64_t o = 0; o < out; o++) y[o] = f32_to_bf16(dot_bf16_bf16(w + o * in, xh, x, in));
#else
    for (int64_t o = 0; o < out; o++) y[o] = f32_to_bf16(dot_bf16(w + o * in, x, in));
#endif
}

#ifdef __FLT16_MAX__
void kv_matvec_f16(const _Float16 *w, const _Float16 *xh, _Float16 *y, int64_t out, int64_t in, int nt) {
    float x[in];
    for (int64_t i = 0; i < in; i++) x[i] = (float)xh[i];
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t o = 0; o < out; o++) y[o] = (_Float16)dot_f16(w + o * in, x, in);
}
#endif

/* Offsets m [out, in/g] (NULL: none) make a group's weights s·q + m (a GGUF's Q4_1/Q5_1 and K-quant
 * mins): their share of a row's product is sum_j m[o, j] * (the sum of x over group j), so x's group sums
 * are taken once per call and each row adds one short dot product (dot_f32). */
static void group_sums(const float *x, float *xs, int64_t groups, int64_t g) {
    for (int64_t j = 0; j < groups; j++) {
        float a = 0;
        for (int64_t i = j * g; i < (j + 1) * g; i++) a += x[i];
        xs[j] = a;
    }
}

#if KV_LANES
/* One group's codes . x, inputs i..end: four chains of FMAs where the group is long enough (their latency,
 * not memory, bounds a long row of int8 codes), two for a group of 32 (a GGUF's Q8_0). */
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

/* A nibble as a 4-bit two's complement int4 code, -8..7. */
static inline int int4_value(unsigned n) { return (int)((n & 15) ^ 8) - 8; }

#if KV_LANES == 16
/* A nibble's int4 value (int4_value) at its index: the table vpermps looks nibbles up in. */
static inline vf int4_values(void) { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1); }

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

/* ---- int4 codes in tiles of 16 rows, for one-row products (float32 activations here, int8 ones below) ----
 * A row's 32 inputs against its 16 bytes of codes leave the vector unit converting nibbles more than
 * multiplying. Sixteen rows side by side make each vector lane one row: a 64-byte load holds 8 inputs of
 * 16 rows, each nibble meets its input's x broadcast to every lane, and the scales (one per row and group)
 * apply once per group to 16 rows at once. Layout, engine.quant.tile's: codes
 * [out/16][in/8][16 rows][4 bytes] — each 4 bytes are 8 inputs of one row as the row layout holds them
 * (input 8b+k in nibble k, low nibble first) — and scales and offsets [out/16][in/g][16 rows]. */
#define TILE_ROWS 16
#define TILE_STEP(i) ((i) / 8 * TILE_ROWS * 4) /* bytes of a tile before the 8-input step holding input i */
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

/* int5 codes as a GGUF's Q5_0/Q5_1 blocks hold them, without their float16 scale: for each group of 32 inputs,
 * 4 bytes of fifth bits (bit i: input i) then 16 bytes whose low nibbles are inputs 0-15 and high nibbles
 * 16-31; a code q (0..31) stands for q - 16, so a weight is s·(q - 16) (+ m). 20 bytes a group: g = 32. */
#define Q5_GROUP 32
#define Q5_BYTES 20
static inline void q5_group(const uint8_t *b, int q[32]) {
    uint32_t qh;
    memcpy(&qh, b, 4);
    for (int i = 0; i < 16; i++) {
        q[i] = (b[4 + i] & 15) | (((qh >> i) & 1) << 4);
        q[i + 16] = (b[4 + i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
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

/* ---- Integer products: activations quantized to int8 (the load option activations="int8") ----
 * x is cut into blocks of 32 inputs, each with its scale d = max|x| / 127 (1 for an all-zero block) and codes
 * c = round_half_even(x / d) in -127..127, so a row's product is sum_b d_b · s · (q . c over block b): integer
 * dot products, four codes a multiply-add instruction (VNNI's vpdpbusd, or AVX2's vpmaddubsw), instead of a
 * float FMA per weight. Those instructions multiply an unsigned byte by a signed one, so a weight code q enters
 * as q + bias (int8 +128, int4 +8, int5 +16, all in 0..255) and each 32-bit lane of four inputs starts from
 * -bias · (their codes' sum), precomputed once a call (`neg`). `d` holds each lane's block scale. Offsets (s·q + m)
 * are added from the float x's group sums, as in the float products. A row needs in % 32 == 0 and groups of whole
 * blocks (g % 32 == 0); other shapes run the float products. */
#define XQ_BLOCK 32
#define XQ_PAD 64 /* buffers padded (codes 0, lanes 0) to whole 64-input steps */

static int int_products_fit(int64_t in, int64_t g) { return in % XQ_BLOCK == 0 && g % XQ_BLOCK == 0 && g > 0; }

/* Where a step's k-th code byte comes from within its 64 inputs: the order in which a mode's reader unpacks
 * them (each 4-byte lane stays inside one block of 32). */
enum { ORDER_PLAIN, ORDER_NIBBLES, ORDER_HALVES, ORDER_TILES };
static inline int order_source(int order, int k) {
    if (order == ORDER_NIBBLES) return k < 32 ? 2 * k : 2 * (k - 32) + 1;       /* low nibbles, then high ones */
    if (order == ORDER_HALVES) return (k & 15) + 32 * ((k >> 4) & 1) + 16 * (k >> 5); /* two int5 blocks' halves */
    if (order == ORDER_TILES) return (k & ~7) + ((k & 7) < 4 ? 2 * (k & 7) : 2 * (k & 3) + 1); /* each 8: even, odd */
    return k;
}

static void quantize_x(const float *x, int64_t in, int bias, int order, int8_t *c, int32_t *neg, float *d) {
    int64_t np = (in + XQ_PAD - 1) / XQ_PAD * XQ_PAD;
    int8_t natural[np];
    float db[np / XQ_BLOCK];
    for (int64_t b = 0; b < np / XQ_BLOCK; b++) {
        int8_t *cb = natural + b * XQ_BLOCK;
        if (b * XQ_BLOCK >= in) { /* padding: codes 0, scale 0 */
            memset(cb, 0, XQ_BLOCK);
            db[b] = 0;
            continue;
        }
        const float *xb = x + b * XQ_BLOCK;
#if KV_LANES == 16 /* the same arithmetic, 16 at a time: max, one correctly rounded division, round half to even */
        __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
        float m = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
        db[b] = m == 0 ? 1 : m / 127.0f;
        __m512 dv = _mm512_set1_ps(db[b]);
        const int rne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        _mm_storeu_si128((__m128i *)cb, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_div_ps(x0, dv), rne))));
        _mm_storeu_si128((__m128i *)(cb + 16),
                         _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_div_ps(x1, dv), rne))));
#else
        float m = 0;
        for (int i = 0; i < XQ_BLOCK; i++) m = fmaxf(m, fabsf(xb[i]));
        db[b] = m == 0 ? 1 : m / 127.0f;
        for (int i = 0; i < XQ_BLOCK; i++) {
            float v = nearbyintf(xb[i] / db[b]);
            cb[i] = (int8_t)(v > 127 ? 127 : (v < -127 ? -127 : v));
        }
#endif
    }
    for (int64_t i = 0; i < np; i += XQ_PAD)
        for (int k = 0; k < XQ_PAD; k++) c[i + k] = natural[i + order_source(order, k)];
    for (int64_t l = 0; l < np / 4; l++) {
        const int8_t *cl = c + 4 * l;
        neg[l] = -bias * ((int32_t)cl[0] + cl[1] + cl[2] + cl[3]);
        d[l] = db[(l / 16 * XQ_PAD + order_source(order, (int)(4 * l % XQ_PAD))) / XQ_BLOCK];
    }
}

/* The unsigned codes (q + bias) of inputs i..i+STEP-1 of a row, per mode. */
#if KV_LANES == 16 && defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define XQ_STEP 64
#define XQ_ISA "avx512-vnni"
#define BIAS8 128
#define ORDER_Q4 ORDER_NIBBLES
#define ORDER_Q5 ORDER_HALVES
typedef __m512i vu;
/* (z & 15) ^ x as one vpternlogd: the truth table of (A & B) ^ C */
#define LOW_NIBBLES_XOR(z, x) _mm512_ternarylogic_epi32(z, _mm512_set1_epi8(15), _mm512_set1_epi8(x), 0x6A)
static inline vu u_q8(const int8_t *r, int64_t i, int64_t in) {
    PREFETCH(r + i);
    __m512i w = in - i >= 64 ? _mm512_loadu_si512(r + i) : _mm512_maskz_loadu_epi8(0xFFFFFFFFull, r + i);
    return _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80));
}
static inline vu u_q4(const uint8_t *r, int64_t i, int64_t in) { /* 32 bytes: low nibbles, then high ones */
    PREFETCH(r + i / 2);
    __m256i b = in - i >= 64 ? _mm256_loadu_si256((const __m256i *)(r + i / 2)) : _mm256_maskz_loadu_epi8(0xFFFF, r + i / 2);
    __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(b), _mm256_srli_epi16(b, 4), 1);
    return LOW_NIBBLES_XOR(z, 8); /* 4-bit two's complement q -> q + 8 */
}
static inline vu u_q5(const uint8_t *r, int64_t i, int64_t in) { /* two blocks: both low halves, both high ones */
    const uint8_t *a = r + i / 32 * 20, *b = a + 20;
    int two = in - i >= 64;
    PREFETCH(a);
    uint32_t qa, qb = 0;
    memcpy(&qa, a, 4);
    __m128i na = _mm_loadu_si128((const __m128i *)(a + 4)), nb = _mm_setzero_si128();
    if (two) {
        memcpy(&qb, b, 4);
        nb = _mm_loadu_si128((const __m128i *)(b + 4));
    }
    __m256i n = _mm256_inserti128_si256(_mm256_castsi128_si256(na), nb, 1);
    __m512i z = LOW_NIBBLES_XOR(_mm512_inserti64x4(_mm512_castsi256_si512(n), _mm256_srli_epi16(n, 4), 1), 0);
    __mmask64 fifth = (uint64_t)(qa & 0xFFFF) | (uint64_t)(qb & 0xFFFF) << 16 | (uint64_t)(qa >> 16) << 32 |
                      (uint64_t)(qb >> 16) << 48;
    return _mm512_or_si512(z, _mm512_maskz_mov_epi8(fifth, _mm512_set1_epi8(16)));
}
/* acc + (the step's int32 lane sums, as float) · scale, where scale holds each lane's d (times s when given) */
static inline __m512 dot_step(vu u, const int8_t *c, const int32_t *neg, int64_t i, __m512 scale, __m512 acc) {
    __m512i dot = _mm512_dpbusd_epi32(_mm512_loadu_si512(neg + i / 4), u, _mm512_loadu_si512(c + i));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc);
}
/* The two blocks' weight scales of a step in one register, where the order puts their lanes: 0-7 and 8-15
 * (plain), or alternating fours (nibbles, halves). */
static inline __m512 scale_pair(const float *so, int64_t i, int64_t in, int64_t g, int order) {
    int64_t b = i / XQ_BLOCK, next = i + XQ_BLOCK < in; /* g == 32 (a GGUF's blocks) without a division */
    __m512 s0 = _mm512_set1_ps(g == XQ_BLOCK ? so[b] : so[i / g]);
    __m512 s1 = _mm512_set1_ps(g == XQ_BLOCK ? so[b + next] : so[(i + next * XQ_BLOCK) / g]);
    return order == ORDER_PLAIN ? _mm512_shuffle_f32x4(s0, s1, 0) : _mm512_mask_blend_ps(0xF0F0, s0, s1);
}
static inline __m512 lane_scales(const float *d, const float *so, int64_t i, int64_t in, int64_t g, int order) {
    return _mm512_mul_ps(_mm512_loadu_ps(d + i / 4), scale_pair(so, i, in, g, order));
}
#elif defined(__AVX2__) && defined(__FMA__)
#define XQ_STEP 32
#define ORDER_Q4 ORDER_PLAIN
#define ORDER_Q5 ORDER_PLAIN
typedef __m256i vu;
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define XQ_ISA "avx-vnni"
#define BIAS8 128
#if defined(__AVXVNNI__)
#define DPBUSD(acc, u, c) _mm256_dpbusd_avx_epi32(acc, u, c)
#else
#define DPBUSD(acc, u, c) _mm256_dpbusd_epi32(acc, u, c)
#endif
#else /* vpmaddubsw sums two products in 16 bits: 255 · 127 · 2 overflows, so int8 uses |q| and c's sign moved */
#define XQ_ISA "avx2"
#define BIAS8 0
#define DPBUSD(acc, u, c) _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, c), _mm256_set1_epi16(1)))
#endif
static inline vu u_q8(const int8_t *r, int64_t i, int64_t in) {
    (void)in;
    PREFETCH(r + i);
    __m256i w = _mm256_loadu_si256((const __m256i *)(r + i));
    return BIAS8 ? _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80)) : w;
}
static inline vu u_q4(const uint8_t *r, int64_t i, int64_t in) {
    (void)in;
    PREFETCH(r + i / 2);
    __m128i b = _mm_loadu_si128((const __m128i *)(r + i / 2)), f = _mm_set1_epi8(15);
    __m128i lo = _mm_and_si128(b, f), hi = _mm_and_si128(_mm_srli_epi16(b, 4), f);
    __m256i u = _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));
    return _mm256_xor_si256(u, _mm256_set1_epi8(8));
}
static inline vu u_q5(const uint8_t *r, int64_t i, int64_t in) {
    (void)in;
    const uint8_t *b = r + i / 32 * 20;
    PREFETCH(b);
    uint32_t qh;
    memcpy(&qh, b, 4);
    __m128i n = _mm_loadu_si128((const __m128i *)(b + 4)), f = _mm_set1_epi8(15);
    __m256i u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(n, 4), f), _mm_and_si128(n, f));
    /* byte k gets 16 when bit k of qh is set: each byte picks its bit from a broadcast of qh */
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh),
                                    _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
    v = _mm256_cmpeq_epi8(_mm256_or_si256(v, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)), _mm256_set1_epi64x(-1));
    return _mm256_or_si256(u, _mm256_and_si256(v, _mm256_set1_epi8(16)));
}
/* acc + (the step's int32 lane sums, as float) · d · s (one block a step: one weight scale) */
static inline __m256 dot_step8(vu u, const int8_t *c, const int32_t *neg, int64_t i, int signed_int8, const float *d,
                               float s, __m256 acc) {
    __m256i cv = _mm256_loadu_si256((const __m256i *)(c + i));
    if (signed_int8) { /* BIAS8 == 0: |q| unsigned, c takes q's sign */
        cv = _mm256_sign_epi8(cv, u);
        u = _mm256_abs_epi8(u);
    }
    __m256 dot = _mm256_cvtepi32_ps(DPBUSD(_mm256_loadu_si256((const __m256i *)(neg + i / 4)), u, cv));
    return _mm256_fmadd_ps(dot, _mm256_mul_ps(_mm256_loadu_ps(d + i / 4), _mm256_set1_ps(s)), acc);
}
#else
#define XQ_STEP 0
#define XQ_ISA "generic"
#define ORDER_Q4 ORDER_PLAIN
#define ORDER_Q5 ORDER_PLAIN
#define BIAS8 128
#endif

/* One row's integer product, for the mode's code reader U and its bias. */
#if XQ_STEP == 64
#define INT_ROW(NAME, T, U, SIGNED8, ORDER)                                                                          \
    static float NAME(const T *r, const float *so, int64_t in, int64_t g, const int8_t *c, const int32_t *neg, \
                      const float *d) {                                                                       \
        __m512 acc = _mm512_setzero_ps();                                                                     \
        if (g % 64 == 0) { /* a group is whole steps: its sum is scaled once */                             \
            for (int64_t j = 0; j < in / g; j++) {                                                            \
                __m512 p0 = _mm512_setzero_ps(), p1 = _mm512_setzero_ps();                                    \
                int64_t i = j * g, end = i + g;                                                               \
                for (; i + 128 <= end; i += 128) {                                                            \
                    p0 = dot_step(U(r, i, in), c, neg, i, _mm512_loadu_ps(d + i / 4), p0);                    \
                    p1 = dot_step(U(r, i + 64, in), c, neg, i + 64, _mm512_loadu_ps(d + (i + 64) / 4), p1);   \
                }                                                                                             \
                if (i < end) p0 = dot_step(U(r, i, in), c, neg, i, _mm512_loadu_ps(d + i / 4), p0);          \
                acc = _mm512_fmadd_ps(_mm512_set1_ps(so[j]), _mm512_add_ps(p0, p1), acc);                     \
            }                                                                                                 \
        } else { /* blocks of one step may have two scales: each lane gets its own */                        \
            __m512 acc1 = _mm512_setzero_ps();                                                                \
            int64_t i = 0;                                                                                    \
            for (; i + 128 <= in; i += 128) {                                                                 \
                acc = dot_step(U(r, i, in), c, neg, i, lane_scales(d, so, i, in, g, ORDER), acc);             \
                acc1 = dot_step(U(r, i + 64, in), c, neg, i + 64, lane_scales(d, so, i + 64, in, g, ORDER), acc1); \
            }                                                                                                 \
            for (; i < in; i += 64) acc = dot_step(U(r, i, in), c, neg, i, lane_scales(d, so, i, in, g, ORDER), acc); \
            acc = _mm512_add_ps(acc, acc1);                                                                   \
        }                                                                                                     \
        return _mm512_reduce_add_ps(acc);                                                                     \
    }
#elif XQ_STEP == 32
#define INT_ROW(NAME, T, U, SIGNED8, ORDER)                                                                          \
    static float NAME(const T *r, const float *so, int64_t in, int64_t g, const int8_t *c, const int32_t *neg, \
                      const float *d) {                                                                       \
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();                                           \
        int64_t i = 0;                                                                                        \
        for (; i + 64 <= in; i += 64) {                                                                       \
            a0 = dot_step8(U(r, i, in), c, neg, i, SIGNED8, d, so[i / g], a0);                                \
            a1 = dot_step8(U(r, i + 32, in), c, neg, i + 32, SIGNED8, d, so[(i + 32) / g], a1);               \
        }                                                                                                     \
        if (i < in) a0 = dot_step8(U(r, i, in), c, neg, i, SIGNED8, d, so[i / g], a0);                        \
        return kv_hsum256(_mm256_add_ps(a0, a1));                                                             \
    }
#else /* plain C: the same integer sums, a block at a time */
/* block b's 32 codes (values, not q + bias) */
static inline void block_q8(const int8_t *r, int64_t b, int q[32]) {
    for (int i = 0; i < 32; i++) q[i] = r[b * 32 + i];
}
static inline void block_q4(const uint8_t *r, int64_t b, int q[32]) {
    for (int i = 0; i < 16; i++) q[2 * i] = int4_value(r[b * 16 + i]), q[2 * i + 1] = int4_value(r[b * 16 + i] >> 4);
}
static inline void block_q5(const uint8_t *r, int64_t b, int q[32]) {
    q5_group(r + b * Q5_BYTES, q);
    for (int i = 0; i < 32; i++) q[i] -= 16;
}
#define INT_ROW(NAME, T, U, SIGNED8, ORDER)                                                                          \
    static float NAME(const T *r, const float *so, int64_t in, int64_t g, const int8_t *c, const int32_t *neg, \
                      const float *d) {                                                                       \
        (void)neg;                                                                                            \
        float a = 0;                                                                                          \
        for (int64_t b = 0; b < in / XQ_BLOCK; b++) {                                                         \
            int q[32];                                                                                        \
            int32_t t = 0;                                                                                    \
            U(r, b, q);                                                                                       \
            for (int i = 0; i < XQ_BLOCK; i++) t += q[i] * c[b * XQ_BLOCK + i];                               \
            a += so[b * XQ_BLOCK / g] * (d[b * 8] * (float)t);                                                \
        }                                                                                                     \
        return a;                                                                                             \
    }
#define u_q8 block_q8
#define u_q4 block_q4
#define u_q5 block_q5
#endif

INT_ROW(int_row_q8, int8_t, u_q8, BIAS8 == 0, ORDER_PLAIN)
INT_ROW(int_row_q4, uint8_t, u_q4, 0, ORDER_Q4)
INT_ROW(int_row_q5, uint8_t, u_q5, 0, ORDER_Q5)

/* y [out] = W x with x quantized as above: codes and scales as the float products take them (mode 8, 4 or 5). */
#define INT_MATVEC(NAME, T, ROW, BIAS, ORDER, BYTES_PER_ROW)                                                         \
    void NAME(const T *q, const float *s, const float *m, const float *x, float *y, int64_t out, int64_t in, \
              int64_t g, int nt) {                                                                            \
        int64_t np = (in + XQ_PAD - 1) / XQ_PAD * XQ_PAD, groups = in / g;                                    \
        int8_t c[np];                                                                                         \
        int32_t neg[np / 4];                                                                                  \
        float d[np / 4], xs[groups];                                                                          \
        quantize_x(x, in, BIAS, ORDER, c, neg, d);                                                                \
        if (m) group_sums(x, xs, groups, g);                                                                  \
        _Pragma("omp parallel for num_threads(nt) schedule(static)")                                          \
        for (int64_t o = 0; o < out; o++) {                                                                   \
            float a = ROW(q + o * (BYTES_PER_ROW), s + o * groups, in, g, c, neg, d);                         \
            y[o] = m ? a + dot_f32(m + o * groups, xs, groups) : a;                                           \
        }                                                                                                     \
    }
INT_MATVEC(int_matvec_q8, int8_t, int_row_q8, BIAS8, ORDER_PLAIN, in)
INT_MATVEC(int_matvec_q4, uint8_t, int_row_q4, 8, ORDER_Q4, in / 2)
INT_MATVEC(int_matvec_q5, uint8_t, int_row_q5, 16, ORDER_Q5, in / 32 * 20)

/* The exported products: integer where the shape fits, the float products otherwise. */
void kv_matvec_q8x(const int8_t *q, const float *s, const float *m, const float *x, float *y, int64_t out,
                   int64_t in, int64_t g, int nt) {
    if (int_products_fit(in, g)) int_matvec_q8(q, s, m, x, y, out, in, g, nt);
    else kv_matvec_q8(q, s, m, x, y, out, in, g, nt);
}
void kv_matvec_q4x(const uint8_t *q, const float *s, const float *m, const float *x, float *y, int64_t out,
                   int64_t in, int64_t g, int nt) {
    if (int_products_fit(in, g)) int_matvec_q4(q, s, m, x, y, out, in, g, nt);
    else kv_matvec_q4(q, s, m, x, y, out, in, g, nt);
}
void kv_matvec_q5x(const uint8_t *q, const float *s, const float *m, const float *x, float *y, int64_t out,
                   int64_t in, int64_t g, int nt) {
    (void)g;
    int_matvec_q5(q, s, m, x, y, out, in, Q5_GROUP, nt);
}
const char *kv_int_isa(void) { return XQ_ISA; }

/* int4 tiles (kv_matvec_q4t's layout) against int8 activations, where 512-bit VNNI runs them: a lane is a row, a
 * 64-byte load holds 8 inputs of 16 rows, and its low nibbles (the even inputs) and high ones (the odd) enter
 * vpdpbusd as q + 8 against x's codes of those inputs broadcast, four to a lane; each block of 32 inputs starts
 * its lanes from -8 · (its codes' sum) and ends in one FMA with d · s for 16 rows. */
#if KV_LANES == 16 && defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define INT_TILES 1
static void int_matvec_q4t(const uint8_t *q, const float *s, const float *m, const float *x, float *y, int64_t out,
                           int64_t in, int64_t g, int nt) {
    int64_t np = (in + XQ_PAD - 1) / XQ_PAD * XQ_PAD, groups = in / g, blocks = in / XQ_BLOCK, tiles = out / TILE_ROWS;
    int32_t c[np / 4], neg[np / 4], block_neg[blocks]; /* c: each 8 inputs' even codes, then odd ones, 4 a lane */
    float d[np / 4], block_d[blocks], xs[groups];
    quantize_x(x, in, 8, ORDER_TILES, (int8_t *)c, neg, d);
    for (int64_t b = 0; b < blocks; b++) {
        block_neg[b] = 0;
        for (int l = 0; l < XQ_BLOCK / 4; l++) block_neg[b] += neg[b * XQ_BLOCK / 4 + l];
        block_d[b] = d[b * XQ_BLOCK / 4];
    }
    if (m) group_sums(x, xs, groups, g);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const uint8_t *r = q + t * TILE_ROWS * in / 2;
        const float *st = s + t * TILE_ROWS * groups;
        vf acc = vzero();
        for (int64_t b = 0; b < blocks; b++) {
            __m512i p = _mm512_set1_epi32(block_neg[b]);
            for (int64_t i = b * XQ_BLOCK; i < (b + 1) * XQ_BLOCK; i += 8) {
                const uint8_t *rb = r + TILE_STEP(i);
                PREFETCH(rb);
                __m512i v = _mm512_loadu_si512(rb);
                p = _mm512_dpbusd_epi32(p, LOW_NIBBLES_XOR(v, 8), _mm512_set1_epi32(c[i / 4]));
                p = _mm512_dpbusd_epi32(p, LOW_NIBBLES_XOR(_mm512_srli_epi32(v, 4), 8), _mm512_set1_epi32(c[i / 4 + 1]));
            }
            acc = vfma(_mm512_cvtepi32_ps(p), vmul(vload(st + b * XQ_BLOCK / g * TILE_ROWS), vset1(block_d[b])), acc);
        }
        if (m)
            for (int64_t j = 0; j < groups; j++) acc = vfma(vload(m + (t * groups + j) * TILE_ROWS), vset1(xs[j]), acc);
        _mm_storeu_acc(y + t * TILE_ROWS, acc);
    }
}
#else
#define INT_TILES 0
#endif
int kv_int4_integer_tiles(void) { return INT_TILES && kv_int4_tile_rows(); }

/* The exported tiled product with int8 activations: integer where it runs and the shape fits, the float one otherwise. */
void kv_matvec_q4tx(const uint8_t *q, const float *s, const float *m, const float *x, float *y, int64_t out,
                    int64_t in, int64_t g, int nt) {
#if INT_TILES
    if (int_products_fit(in, g)) {
        int_matvec_q4t(q, s, m, x, y, out, in, g, nt);
        return;
    }
#endif
    kv_matvec_q4t(q, s, m, x, y, out, in, g, nt);
}

/* ---- The rest of a decode step: RMSNorm and attention for one position (B = 1) ----
 * Each exists for float32, bfloat16 and float16 storage, computes in float32 and rounds where torch's
 * eager code rounds (after the norm, after the rotation), so decode matches prefill's torch path. */

static inline float f32_id(float f) { return f; }
#define F32_TO(f) (f)
#define BF16_TO(f) f32_to_bf16(f)
#define F16_TO(f) ((_Float16)(f))

/* y = w * (x / rms(x)): float32 as F.rms_norm; 16-bit types as transformers: normalise in float32,
 * round, then scale. */
#define RMSNORM(NAME, T, TO_F32, FROM_F32, ROUND)                                                  \
    void NAME(const T *x, const T *w, T *y, int64_t n, float eps) {                                 \
        float ss = 0;                                                                               \
        for (int64_t i = 0; i < n; i++) ss += TO_F32(x[i]) * TO_F32(x[i]);                          \
        float r = 1.0f / sqrtf(ss / (float)n + eps);                                                \
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
 * of its group's KV head with a one-pass (online) softmax; y [H d]. */
#define ATTEND(NAME, ROT, DOT, AXPY, T, TO_F32, FROM_F32, ROUND)                                              \
    void NAME(const T *qkv, const T *cs, const T *sn, const T *qn, const T *kn, float eps, T *kc, T *vc, \
              int64_t cap, int64_t pos, int64_t lo, int64_t H, int64_t Hkv, int64_t d, float scale, T *y, int nt) { \
        for (int64_t h = 0; h < Hkv; h++) {                                                         \
            float k[d];                                                                             \
            ROT(qkv + (H + h) * d, kn, eps, cs, sn, k, d);                                          \
            T *kd = kc + (h * cap + pos) * d, *vd = vc + (h * cap + pos) * d;                       \
            const T *v = qkv + (H + Hkv + h) * d;                                                   \
            for (int64_t i = 0; i < d; i++) { kd[i] = FROM_F32(k[i]); vd[i] = v[i]; }               \
        }                                                                                           \
        int64_t G = H / Hkv;                                                                        \
        _Pragma("omp parallel for num_threads(nt) schedule(static)")                                \
        for (int64_t h = 0; h < H; h++) {                                                           \
            float q[d], acc[d], s[ATTEND_CHUNK];                                                    \
            ROT(qkv + h * d, qn, eps, cs, sn, q, d);                                                \
            const T *K = kc + (h / G) * cap * d, *V = vc + (h / G) * cap * d;                       \
            float m = -INFINITY, l = 0;                                                             \
            for (int64_t i = 0; i < d; i++) acc[i] = 0;                                             \
            for (int64_t j0 = lo; j0 <= pos; j0 += ATTEND_CHUNK) {                                  \
                int64_t n = pos + 1 - j0 < ATTEND_CHUNK ? pos + 1 - j0 : ATTEND_CHUNK;              \
                float mc = -INFINITY;                                                               \
                for (int64_t j = 0; j < n; j++) { /* scores: independent dot products */            \
                    s[j] = DOT(K + (j0 + j) * d, q, d) * scale;                                     \
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
                    AXPY(acc, 1.0f, s[j], V + (j0 + j) * d, d);                                     \
                }                                                                                   \
            }                                                                                       \
            for (int64_t i = 0; i < d; i++) y[h * d + i] = FROM_F32(acc[i] / l);                    \
        }                                                                                           \
    }

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }
RMSNORM(kv_rmsnorm_f32, float, f32_id, F32_TO, f32_id)
RMSNORM(kv_rmsnorm_bf16, uint16_t, bf16_to_f32, BF16_TO, round_bf16)
ROTATE(rotate_f32, float, f32_id, F32_TO, f32_id)
ROTATE(rotate_bf16, uint16_t, bf16_to_f32, BF16_TO, round_bf16)
ATTEND(kv_attend_f32, rotate_f32, dot_f32, axpy_f32, float, f32_id, F32_TO, f32_id)
ATTEND(kv_attend_bf16, rotate_bf16, dot_bf16, axpy_bf16, uint16_t, bf16_to_f32, BF16_TO, round_bf16)
#ifdef __FLT16_MAX__
static inline float f16_to_f32(_Float16 h) { return (float)h; }
static inline float round_f16(float f) { return (float)(_Float16)f; }
RMSNORM(kv_rmsnorm_f16, _Float16, f16_to_f32, F16_TO, round_f16)
ROTATE(rotate_f16, _Float16, f16_to_f32, F16_TO, round_f16)
ATTEND(kv_attend_f16, rotate_f16, dot_f16, axpy_f16, _Float16, f16_to_f32, F16_TO, round_f16)
#endif

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

/* ---- A whole decode step's layers in one call (batch 1, one position) ----
 * The same kernels as above, in the order engine/model.py's Block runs them, with the same roundings
 * (each op's output is rounded to the model's type, as the eager torch ops round): nothing crosses
 * into Python between layers. */
typedef struct {
    const void *w;        /* float weight [out, in] of the model's type, or int8 codes / int4 codes two a byte */
    const float *scales;  /* [out, in/group] for codes, NULL for float weights */
    const float *mins;    /* [out, in/group] offsets (weights s·q + m), or NULL */
    const void *bias;     /* [out] of the model's type, or NULL */
    int64_t out, in, group;
    int64_t mode;         /* 0 float, 8 int8, 5 int5 (a GGUF's Q5 blocks), 4 int4 */
    int64_t act;          /* codes' products: 0 with float32 activations, 8 with int8 ones (kv_matvec_q8x, ...) */
    int64_t tiles;        /* int4 codes in tiles of this many rows (kv_matvec_q4t), 0 in rows */
} kv_linear;

typedef struct {
    const void *attn_norm, *mlp_norm, *q_norm, *k_norm; /* q_norm, k_norm NULL without (Qwen3 has them) */
    kv_linear qkv, o, gate_up, down;
    void *k_cache, *v_cache; /* this layer's [H_kv, cap, d] */
} kv_layer;

static void quant_matvec(const kv_linear *l, const float *x, float *y, int nt) {
    typedef void (*product)(const void *, const float *, const float *, const float *, float *, int64_t, int64_t,
                            int64_t, int);
    product f = l->mode == 8 ? (l->act ? (product)kv_matvec_q8x : (product)kv_matvec_q8)
                : l->mode == 5 ? (l->act ? (product)kv_matvec_q5x : (product)kv_matvec_q5)
                               : (l->act ? (product)kv_matvec_q4x : (product)kv_matvec_q4);
    if (l->tiles) f = l->act ? (product)kv_matvec_q4tx : (product)kv_matvec_q4t;
    f(l->w, l->scales, l->mins, x, y, l->out, l->in, l->group, nt);
}

#define DECODE(SUF, T, TO_F32, FROM_F32)                                                                   \
    static void linear_##SUF(const kv_linear *l, const T *x, T *y, float *fx, float *fy, int nt) {          \
        if (l->mode == 0) {                                                                                 \
            kv_matvec_##SUF((const void *)l->w, (const void *)x, (void *)y, l->out, l->in, nt);            \
        } else {                                                                                            \
            for (int64_t i = 0; i < l->in; i++) fx[i] = TO_F32(x[i]);                                       \
            quant_matvec(l, fx, fy, nt);                                                                    \
            for (int64_t i = 0; i < l->out; i++) y[i] = FROM_F32(fy[i]);                                    \
        }                                                                                                   \
        if (l->bias) {                                                                                      \
            const T *b = l->bias;                                                                           \
            for (int64_t i = 0; i < l->out; i++) y[i] = FROM_F32(TO_F32(y[i]) + TO_F32(b[i]));              \
        }                                                                                                   \
    }                                                                                                       \
    void kv_decode_layers_##SUF(const kv_layer *layers, int64_t n_layers, T *x, const T *cs, const T *sn,   \
                                float eps, float qk_eps, int64_t cap, int64_t pos, int64_t lo, int64_t H,   \
                                int64_t Hkv, int64_t d, int64_t D, int64_t F, T *h, T *qkv, T *att, T *t,   \
                                T *gu, float *fx, float *fy, int nt) {                                      \
        for (int64_t n = 0; n < n_layers; n++) {                                                            \
            const kv_layer *L = layers + n;                                                                 \
            kv_rmsnorm_##SUF(x, L->attn_norm, h, D, eps);                                                   \
            linear_##SUF(&L->qkv, h, qkv, fx, fy, nt);                                                      \
            kv_attend_##SUF(qkv, cs, sn, L->q_norm, L->k_norm, qk_eps, L->k_cache, L->v_cache, cap, pos, lo, \
                            H, Hkv, d, 1.0f / sqrtf((float)d), att, nt);                                    \
            linear_##SUF(&L->o, att, t, fx, fy, nt);                                                        \
            for (int64_t i = 0; i < D; i++) x[i] = FROM_F32(TO_F32(x[i]) + TO_F32(t[i]));                   \
            kv_rmsnorm_##SUF(x, L->mlp_norm, h, D, eps);                                                    \
            linear_##SUF(&L->gate_up, h, gu, fx, fy, nt);                                                   \
            for (int64_t i = 0; i < F; i++) fx[i] = TO_F32(gu[i]);                                          \
            silu_f32(fx, fx, F);                                                                            \
            for (int64_t i = 0; i < F; i++) /* silu(gate) * up, each rounded as torch rounds */             \
                gu[i] = FROM_F32(TO_F32(FROM_F32(fx[i])) * TO_F32(gu[F + i]));                              \
            linear_##SUF(&L->down, gu, t, fx, fy, nt);                                                      \
            for (int64_t i = 0; i < D; i++) x[i] = FROM_F32(TO_F32(x[i]) + TO_F32(t[i]));                   \
        }                                                                                                   \
    }

DECODE(f32, float, f32_id, F32_TO)
DECODE(bf16, uint16_t, bf16_to_f32, BF16_TO)
#ifdef __FLT16_MAX__
DECODE(f16, _Float16, f16_to_f32, F16_TO)
#endif
