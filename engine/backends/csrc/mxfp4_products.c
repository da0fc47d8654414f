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

#if KV_LANES == 16 && defined(__AVX512BF16__)
/* Where x is bfloat16 (a bfloat16 model's activations: each float32 of x has zero low 16 bits), the codes become
 * bfloat16 words and vdpbf16ps multiplies 32 pairs of them with x's words a step, exactly in float32, as the FMAs
 * below do (x's subnormals, below 2^-126, count as 0 there). A 64-byte load holds 4 blocks; its 16-bit words' four
 * nibbles (inputs 4m + k of the 128) are looked up as bfloat16 by vpermw, x's words de-interleaved by 4 to meet
 * them, and each 128-bit lane of the sums is one block's, scaled in the lane (mx4_lane_scales), with no pass over a
 * row's scales first. */
static const uint16_t MX4_BF16[32] = { /* MX4_CODES as bfloat16, twice: vpermw reads an index's low 5 bits */
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40C0, 0x4100, 0x4140, 0x8000, 0xBF80, 0xC000, 0xC040, 0xC080, 0xC0C0,
    0xC100, 0xC140, 0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40C0, 0x4100, 0x4140, 0x8000, 0xBF80, 0xC000, 0xC040,
    0xC080, 0xC0C0, 0xC100, 0xC140};

static int bf16_exact(const float *x, int64_t n) { /* every value's low 16 bits zero */
    __m512i any = _mm512_setzero_si512();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) any = _mm512_or_si512(any, _mm512_loadu_si512(x + i));
    uint32_t low = (uint32_t)_mm512_reduce_or_epi32(_mm512_and_si512(any, _mm512_set1_epi32(0xFFFF)));
    for (; i < n; i++) {
        uint32_t b;
        memcpy(&b, x + i, 4);
        low |= b & 0xFFFF;
    }
    return low == 0;
}

/* the nibbles at bit `shift` of b's 16-bit words as bfloat16 values; 32 of x's words */
#define mx4_words(b, shift, table) ((__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(b, shift), table))
#define mx4_x(p) ((__m512bh)_mm512_loadu_si512(p))

static void mx4_bf16(const uint8_t *q, const uint8_t *e, const float *x, float *y, int64_t out, int64_t in, int nt) {
    const int64_t groups = in / MX_GROUP, half = in / 2, steps = (in + 127) / 128;
    uint16_t xw[steps * 128]; /* step c's words: 32 for each k, word m of them x[128c + 4m + k] (0 past the end) */
    for (int64_t c = 0; c < steps; c++)
        for (int k = 0; k < 4; k++)
            for (int m = 0; m < 32; m++) {
                int64_t i = c * 128 + 4 * m + k;
                uint32_t b = 0;
                if (i < groups * MX_GROUP) memcpy(&b, x + i, 4);
                xw[c * 128 + 32 * k + m] = (uint16_t)(b >> 16);
            }
    const __m512i table = _mm512_loadu_si512(MX4_BF16);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t o = 0; o < out; o++) {
        const uint8_t *r = q + o * half, *eo = e + o * groups;
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
        for (int64_t c = 0; c < steps; c++) {
            uint32_t e4;
            __m512i b;
            mx4_step(r, eo, c, groups, &b, &e4);
            const uint16_t *xc = xw + 128 * c;
            __m512 p0 = _mm512_dpbf16_ps(_mm512_setzero_ps(), mx4_words(b, 0, table), mx4_x(xc));
            __m512 p1 = _mm512_dpbf16_ps(_mm512_setzero_ps(), mx4_words(b, 4, table), mx4_x(xc + 32));
            p0 = _mm512_dpbf16_ps(p0, mx4_words(b, 8, table), mx4_x(xc + 64));
            p1 = _mm512_dpbf16_ps(p1, mx4_words(b, 12, table), mx4_x(xc + 96));
            const __m512 s = mx4_lane_scales(e4);
            if (c & 1) a1 = _mm512_fmadd_ps(s, _mm512_add_ps(p0, p1), a1);
            else a0 = _mm512_fmadd_ps(s, _mm512_add_ps(p0, p1), a0);
        }
        y[o] = 0.5f * _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    }
}
#endif

void kv_matvec_mx4(const uint8_t *q, const uint8_t *e, const float *m, const float *x, float *y, int64_t out,
                   int64_t in, int64_t g, int nt) {
    (void)m, (void)g; /* no offsets; blocks of 32 */
#if KV_LANES == 16 && defined(__AVX512BF16__)
    if (bf16_exact(x, in)) {
        mx4_bf16(q, e, x, y, out, in, nt);
        return;
    }
#endif
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
