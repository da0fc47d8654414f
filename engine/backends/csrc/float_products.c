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
