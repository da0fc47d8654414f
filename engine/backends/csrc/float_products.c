/* One-row products of float weights (float32, bfloat16, float16) in their checkpoint layout [out, in]: each
 * output row one contiguous dot product, rows split over torch's OpenMP threads, float32 accumulation. */
#include "simd.h"
#include "kernels.h"

const char *kv_isa(void) { return KV_ISA; }

/* y [out] = W [out, in] x [in]; x and y in W's type (x is widened to float32 once). */
void kv_matvec_f32(const float *w, const float *x, float *y, int64_t out, int64_t in, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t o = 0; o < out; o++) y[o] = dot_f32(w + o * in, x, in);
}

/* Float weights for several rows of x at once (B sequences' decode steps, a verify's positions): x [B, in] float32
 * rows xs apart. Each weight vector is loaded (and widened, for bfloat16 and float16) once for up to four rows
 * of x, each row's two chains and scalar tail as the one-row dot product (ROW_DOT) keeps them, so every row's
 * outputs are its one-row product's bit for bit while the weights are read from memory once. */
#define FLOAT_ROWS(NAME, WT, LOADW, SCALARW, NB)                                                                  \
    static void NAME##NB(const WT *restrict r, const float *restrict x, int64_t xs, float *a, int64_t in) {      \
        int64_t i = 0;                                                                                           \
        for (int b = 0; b < NB; b++) a[b] = 0;                                                                   \
        FLOAT_ROWS_SIMD(LOADW, NB)                                                                               \
        for (; i < in; i++)                                                                                      \
            for (int b = 0; b < NB; b++) a[b] += SCALARW(r[i]) * x[b * xs + i];                                  \
    }
#if KV_LANES
#define FLOAT_ROWS_SIMD(LOADW, NB)                                                                               \
    vf a0[NB], a1[NB];                                                                                           \
    for (int b = 0; b < NB; b++) a0[b] = a1[b] = vzero();                                                       \
    for (; i + 2 * KV_LANES <= in; i += 2 * KV_LANES) {                                                          \
        PREFETCH(r + i);                                                                                         \
        if (sizeof(*r) * 2 * KV_LANES > 64) PREFETCH((const char *)(r + i) + 64);                                \
        vf w0 = LOADW(r + i), w1 = LOADW(r + i + KV_LANES);                                                      \
        for (int b = 0; b < NB; b++) {                                                                           \
            a0[b] = vfma(w0, vload(x + b * xs + i), a0[b]);                                                      \
            a1[b] = vfma(w1, vload(x + b * xs + i + KV_LANES), a1[b]);                                           \
        }                                                                                                        \
    }                                                                                                            \
    for (int b = 0; b < NB; b++) a[b] = vsum(vadd(a0[b], a1[b]));
#else
#define FLOAT_ROWS_SIMD(LOADW, NB)
#endif
/* y [B, out] (rows ys apart) = row o of W [out, in] for every row of x, rows of W over the threads and four rows of x
 * a call: FN##nb(args...) fills a[0..nb) for W's row r and x's rows from b0 (the enclosing function's w, y, ys, out,
 * in, B and nt) */
#define FOUR_ROWS_A_CALL(WT, FN, ...)                                                                             \
    _Pragma("omp parallel for num_threads(nt) schedule(static)") for (int64_t o = 0; o < out; o++) {             \
        const WT *r = w + o * in;                                                                                \
        for (int64_t b0 = 0; b0 < B; b0 += 4) {                                                                  \
            float a[4];                                                                                          \
            int64_t nb = B - b0 < 4 ? B - b0 : 4;                                                                \
            switch (nb) {                                                                                        \
            case 1: FN##1(__VA_ARGS__); break;                                                                   \
            case 2: FN##2(__VA_ARGS__); break;                                                                   \
            case 3: FN##3(__VA_ARGS__); break;                                                                   \
            default: FN##4(__VA_ARGS__);                                                                         \
            }                                                                                                    \
            for (int64_t b = 0; b < nb; b++) y[(b0 + b) * ys + o] = a[b];                                        \
        }                                                                                                        \
    }
#define FLOAT_ROWS_1_TO_4(NAME, WT, LOADW, SCALARW)                                                              \
    FLOAT_ROWS(NAME, WT, LOADW, SCALARW, 1)                                                                      \
    FLOAT_ROWS(NAME, WT, LOADW, SCALARW, 2)                                                                      \
    FLOAT_ROWS(NAME, WT, LOADW, SCALARW, 3)                                                                      \
    FLOAT_ROWS(NAME, WT, LOADW, SCALARW, 4)                                                                      \
    static void NAME(const WT *w, const float *x, int64_t xs, float *y, int64_t ys, int64_t out, int64_t in,     \
                     int64_t B, int nt) {                                                                        \
        FOUR_ROWS_A_CALL(WT, NAME, r, x + b0 * xs, xs, a, in)                                                    \
    }
FLOAT_ROWS_1_TO_4(f32_rows, float, vload, AS_FLOAT)

void kv_matvec_f32_rows(const float *w, const float *x, int64_t xs, float *y, int64_t ys, int64_t out, int64_t in,
                        int64_t B, int nt) {
    f32_rows(w, x, xs, y, ys, out, in, B, nt);
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

/* bfloat16 weights for B rows of x: xh [B, in] bfloat16 rows xhs apart and the same rows widened, x [B, in];
 * y [B, out] float32, unrounded. Each row's sums are kv_matvec_bf16's for that row alone, bit for bit (the same
 * chains, reduction and tail), while each weight vector is loaded once for up to four rows. */
#if KV_LANES == 16 && defined(__AVX512BF16__)
#define BF16_PAIRS(NB)                                                                                            \
    static void bf16_pairs##NB(const uint16_t *restrict r, const uint16_t *restrict xh, int64_t xhs,             \
                               const float *restrict x, int64_t xs, float *a, int64_t in) {                      \
        __m512 a0[NB], a1[NB];                                                                                   \
        for (int b = 0; b < NB; b++) a0[b] = a1[b] = _mm512_setzero_ps();                                       \
        int64_t i = 0;                                                                                           \
        for (; i + 64 <= in; i += 64) {                                                                          \
            PREFETCH(r + i);                                                                                     \
            PREFETCH(r + i + 32);                                                                                \
            __m512bh w0 = (__m512bh)_mm512_loadu_si512(r + i), w1 = (__m512bh)_mm512_loadu_si512(r + i + 32);    \
            for (int b = 0; b < NB; b++) {                                                                       \
                a0[b] = _mm512_dpbf16_ps(a0[b], w0, (__m512bh)_mm512_loadu_si512(xh + b * xhs + i));            \
                a1[b] = _mm512_dpbf16_ps(a1[b], w1, (__m512bh)_mm512_loadu_si512(xh + b * xhs + i + 32));       \
            }                                                                                                    \
        }                                                                                                        \
        for (int b = 0; b < NB; b++)                                                                             \
            a[b] = _mm512_reduce_add_ps(_mm512_add_ps(a0[b], a1[b])) + dot_bf16(r + i, x + b * xs + i, in - i);  \
    }
BF16_PAIRS(1)
BF16_PAIRS(2)
BF16_PAIRS(3)
BF16_PAIRS(4)
#else
FLOAT_ROWS_1_TO_4(bf16_rows, uint16_t, vload_bf16, bf16_to_f32)
#endif

void kv_matvec_bf16_rows(const uint16_t *w, const uint16_t *xh, int64_t xhs, const float *x, float *y, int64_t out,
                         int64_t in, int64_t B, int nt) {
#if KV_LANES == 16 && defined(__AVX512BF16__)
    const int64_t ys = out;
    FOUR_ROWS_A_CALL(uint16_t, bf16_pairs, r, xh + b0 * xhs, xhs, x + b0 * in, in, a, in)
#else
    (void)xh, (void)xhs;
    bf16_rows(w, x, in, y, out, out, in, B, nt);
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

#ifdef __FLT16_MAX__
FLOAT_ROWS_1_TO_4(f16_rows, _Float16, vload_f16, AS_FLOAT)

/* float16 weights for B rows of x [B, in] widened to float32; y [B, out] float32, unrounded: each row's sums
 * kv_matvec_f16's for it alone, bit for bit. */
void kv_matvec_f16_rows(const _Float16 *w, const float *x, float *y, int64_t out, int64_t in, int64_t B, int nt) {
    f16_rows(w, x, in, y, out, out, in, B, nt);
}
#endif

/* n float32 values from p summed with eight chains of vector adds and the weight loops' prefetch. */
static float sum_part(const float *p, int64_t m) {
    int64_t i = 0;
    float a = 0;
#if KV_LANES
    vf s[8];
    for (int k = 0; k < 8; k++) s[k] = vzero();
    for (; i + 8 * KV_LANES <= m; i += 8 * KV_LANES) {
        PREFETCH(p + i);
        if (8 * KV_LANES * 4 > 64) PREFETCH((const char *)(p + i) + 64);
        if (8 * KV_LANES * 4 > 128) {
            PREFETCH((const char *)(p + i) + 128);
            PREFETCH((const char *)(p + i) + 192);
        }
        for (int k = 0; k < 8; k++) s[k] = vadd(s[k], vload(p + i + k * KV_LANES));
    }
    for (int k = 1; k < 8; k++) s[0] = vadd(s[0], s[k]);
    a = vsum(s[0]);
#endif
    for (; i < m; i++) a += p[i];
    return a;
}

/* The read roofline of `engine bench`: the sum of n float32 values on nt threads, each thread one contiguous
 * part (as a weight matrix's rows are split), so that nothing but memory bounds it (a decode step reads, it
 * barely writes). */
float kv_read_stream(const float *x, int64_t n, int nt) {
    float total = 0;
#pragma omp parallel for num_threads(nt) schedule(static) reduction(+ : total)
    for (int t = 0; t < nt; t++) {
        int64_t a = n * t / nt, b = n * (t + 1) / nt;
        total += sum_part(x + a, b - a);
    }
    return total;
}
