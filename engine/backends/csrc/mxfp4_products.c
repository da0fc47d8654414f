/* One-row products and dequantization of MXFP4 codes (gpt-oss's experts; the OCP microscaling format): blocks of
 * 32 values, each a 4-bit e2m1 code, two a byte [out, in/2] (value 2k in byte k's low nibble, 2k + 1 in its high
 * one: int4's packing), and a scale per block as the file holds it, e8m0 e [out, in/32] (2^(e − 127)); since
 * MX4_CODES holds the e2m1 values doubled (whole numbers), a block's scale is taken halved, 2^(e − 128)
 * (mx4_scale; both in simd.h), and a code n stands for 2^(e − 128) · MX4_CODES[n], exact in float32. */
#include "simd.h"
#include "kernels.h"


#if KV_LANES == 16
/* inputs i..i+15 of the evens and odds: each nibble's s · value looked up in `table` (vpermps), then an FMA each */
static inline void mx_step(const uint8_t *r, const float *xe, const float *xo, int64_t i, vf table, vf *a, vf *b) {
    PREFETCH(r + i);
    vi c = vload_u8_i32(r + i);
    *a = vfma(_mm512_permutexvar_ps(c, table), vload(xe + i), *a);
    *b = vfma(_mm512_permutexvar_ps(vi_shr4(c), table), vload(xo + i), *b);
}
#elif KV_LANES == 8
/* the values of bytes i..i+7's low and high nibbles, as float (a byte shuffle looks the nibbles up) */
static inline void mx_values8(const uint8_t *r, int64_t i, vf *lo, vf *hi) {
    PREFETCH(r + i);
    const __m128i lut = _mm_loadu_si128((const __m128i *)MX4_CODES), low = _mm_set1_epi8(15);
    __m128i b = _mm_loadl_epi64((const __m128i *)(r + i));
    *lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_shuffle_epi8(lut, _mm_and_si128(b, low))));
    *hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(b, 4), low))));
}
#elif KV_LANES == 4
static inline void mx_values8(const uint8_t *r, int64_t i, vf *lo, vf *hi) { /* bytes i..i+3 (NEON's table) */
    const int8x16_t lut = vld1q_s8(MX4_CODES);
    uint8x8_t b = vreinterpret_u8_s8(kv_load4_s8(r + i));
    int8x8_t l = vqtbl1_s8(lut, vand_u8(b, vdup_n_u8(15))), h = vqtbl1_s8(lut, vshr_n_u8(b, 4));
    *lo = vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(l))));
    *hi = vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(h))));
}
#endif

void kv_matvec_mx4(const uint8_t *q, const uint8_t *e, const float *m, const float *x, float *y, int64_t out,
                   int64_t in, int64_t g, int nt) {
    (void)m, (void)g; /* no offsets; blocks of 32 */
    const int64_t groups = in / MX_GROUP, half = in / 2, hg = MX_GROUP / 2;
    float xe[half], xo[half];
    for (int64_t i = 0; i < half; i++) { /* x split into evens and odds once: a byte's nibbles meet them lane by lane */
        xe[i] = x[2 * i];
        xo[i] = x[2 * i + 1];
    }
#if KV_LANES == 16
    const vf values = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)MX4_CODES)));
#endif
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t o = 0; o < out; o++) {
        const uint8_t *r = q + o * half;
        float so[groups];
        mx4_scales(e + o * groups, so, groups);
#if KV_LANES == 16
        vf a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero(); /* two blocks a turn: four FMA chains */
        int64_t j = 0;
        for (; j + 2 <= groups; j += 2) {
            mx_step(r, xe, xo, j * hg, vmul(vset1(so[j]), values), &a0, &a1);
            mx_step(r, xe, xo, (j + 1) * hg, vmul(vset1(so[j + 1]), values), &a2, &a3);
        }
        if (j < groups) mx_step(r, xe, xo, j * hg, vmul(vset1(so[j]), values), &a0, &a1);
        y[o] = vsum(vadd(vadd(a0, a1), vadd(a2, a3)));
#elif KV_LANES
        vf acc = vzero();
        for (int64_t j = 0; j < groups; j++) {
            vf p = vzero(), lo, hi;
            for (int64_t i = j * hg; i < (j + 1) * hg; i += KV_LANES) {
                mx_values8(r, i, &lo, &hi);
                p = vfma(lo, vload(xe + i), p);
                p = vfma(hi, vload(xo + i), p);
            }
            acc = vfma(vset1(so[j]), p, acc);
        }
        y[o] = vsum(acc);
#else
        float a = 0;
        for (int64_t j = 0; j < groups; j++) {
            float p = 0;
            for (int64_t i = j * hg; i < (j + 1) * hg; i++)
                p += (float)MX4_CODES[r[i] & 15] * xe[i] + (float)MX4_CODES[r[i] >> 4] * xo[i];
            a += so[j] * p;
        }
        y[o] = a;
#endif
    }
}

void kv_dequant_mx4(const uint8_t *q, const uint8_t *e, const float *m, float *w, int64_t out, int64_t in, int64_t g,
                    int nt) {
    (void)m, (void)g;
    const int64_t groups = in / MX_GROUP, half = in / 2;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t o = 0; o < out; o++)
        for (int64_t j = 0; j < groups; j++) {
            const float sc = mx4_scale(e[o * groups + j]);
            const uint8_t *r = q + o * half + j * MX_GROUP / 2;
            float *d = w + o * in + j * MX_GROUP;
            for (int64_t i = 0; i < MX_GROUP / 2; i++) {
                d[2 * i] = sc * (float)MX4_CODES[r[i] & 15];
                d[2 * i + 1] = sc * (float)MX4_CODES[r[i] >> 4];
            }
        }
}
