/* The instruction-set mappings every kernel file shares: one vector type and its operations for AVX-512
 * (16 lanes), AVX2 + FMA + F16C (8 lanes), aarch64's NEON (4 lanes) or none (plain C, KV_LANES 0; also
 * forced by -DKV_GENERIC on ARM), chosen by the compiler's target and -m flags;
 * the prefetch distance; 16-bit float conversions; the row dot products and e^x every area uses; and the
 * code layouts' small helpers (int4 nibbles, int5 blocks, int4 tiles). Static inline: each file gets its own copy. */
#ifndef KV_SIMD_H
#define KV_SIMD_H

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
#define vsub(a, b) _mm512_sub_ps(a, b)
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
#define vsub(a, b) _mm256_sub_ps(a, b)
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
#elif defined(__aarch64__) && defined(__ARM_NEON) && !defined(KV_GENERIC)
#include <arm_neon.h>
#define KV_LANES 4
typedef float32x4_t vf;
typedef int32x4_t vi;
#define vzero() vdupq_n_f32(0.0f)
#define vset1(s) vdupq_n_f32(s)
#define vload(p) vld1q_f32(p)
#define vfma(a, b, c) vfmaq_f32(c, a, b) /* a·b + c, as the x86 forms read */
#define vadd(a, b) vaddq_f32(a, b)
#define vsub(a, b) vsubq_f32(a, b)
#define vmul(a, b) vmulq_f32(a, b)
#define VDIV(a, b) vdivq_f32(a, b)
#define _mm_storeu_acc(p, v) vst1q_f32(p, v)
#define vsum(v) vaddvq_f32(v)
#define vload_f16(p) vcvt_f32_f16(vld1_f16((const __fp16 *)(p)))
#define vload_bf16(p) vreinterpretq_f32_u32(vshll_n_u16(vld1_u16((const uint16_t *)(p)), 16))
static inline int8x8_t kv_load4_s8(const void *p) { /* 4 bytes, never a byte past them */
    int32_t t;
    memcpy(&t, p, 4);
    return vreinterpret_s8_s32(vdup_n_s32(t));
}
#define vload_i8(p) vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(kv_load4_s8(p)))))
#define vload_u8_i32(p) vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(vmovl_u8(vreinterpret_u8_s8(kv_load4_s8(p))))))
#define vi_and(a, m) vandq_s32(a, vdupq_n_s32(m))
#define vi_shr4(a) vshrq_n_s32(a, 4) /* codes are non-negative: the same as a logical shift */
#define vi_sext4(a) vsubq_s32(veorq_s32(a, vdupq_n_s32(8)), vdupq_n_s32(8))
#define vi_float(a) vcvtq_f32_s32(a)
#define KV_ISA "neon"
#else
#define KV_LANES 0
#define KV_ISA "generic"
#endif

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
#elif KV_LANES == 8
#define vround(x) _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#else
#define vround(x) vrndnq_f32(x)
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
#elif KV_LANES == 4 /* NEON: AVX2's arithmetic below, lane for lane */
    vf xc = vminq_f32(vmaxq_f32(x, vset1(-87.3f)), vset1(88.8f)), k = vround(vmul(xc, vset1(1.44269504f)));
    int32x4_t ki = vcvtq_s32_f32(k), k1 = vshrq_n_s32(ki, 1), k2 = vsubq_s32(ki, k1);
    vf s1 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(k1, vdupq_n_s32(127)), 23));
    vf s2 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(k2, vdupq_n_s32(127)), 23));
    vf e = vmul(vmul(exp_of_remainder(xc, k), s1), s2);
    return vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(e), vcgtq_f32(x, vset1(-87.3f))));
#else
    /* x clamped to -87.3..88.8 makes k -126..128; 2^k is applied as two halves, each a normal float: one factor
     * of 2^128 (or 2^127 built past its exponent) overflowed into the sign bit, so e^x of x > 88 was a negative
     * number and silu of a gate below -88 was garbage. Past 88.72 the product is +inf, as e^x is. */
    vf xc = _mm256_min_ps(_mm256_max_ps(x, vset1(-87.3f)), vset1(88.8f)), k = vround(vmul(xc, vset1(1.44269504f)));
    __m256i ki = _mm256_cvtps_epi32(k), k1 = _mm256_srai_epi32(ki, 1), k2 = _mm256_sub_epi32(ki, k1);
    vf s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k1, _mm256_set1_epi32(127)), 23));
    vf s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k2, _mm256_set1_epi32(127)), 23));
    vf e = vmul(vmul(exp_of_remainder(xc, k), s1), s2);
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

/* Offsets m [out, in/g] (NULL: none) make a group's weights s·q + m (a GGUF's Q4_1/Q5_1 and K-quant
 * mins): their share of a row's product is sum_j m[o, j] * (the sum of x over group j), so x's group sums
 * are taken once per call and each row adds one short dot product (dot_f32). */
static inline void group_sums(const float *x, float *xs, int64_t groups, int64_t g) {
    for (int64_t j = 0; j < groups; j++) {
        float a = 0;
        for (int64_t i = j * g; i < (j + 1) * g; i++) a += x[i];
        xs[j] = a;
    }
}

/* A nibble as a 4-bit two's complement int4 code, -8..7. */
static inline int int4_value(unsigned n) { return (int)((n & 15) ^ 8) - 8; }

#if KV_LANES == 16
/* A nibble's int4 value (int4_value) at its index: the table vpermps looks nibbles up in. */
static inline vf int4_values(void) { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1); }
#endif

/* MXFP4: each 4-bit code's e2m1 value doubled (whole numbers, engine.quant.MXFP4_CODES), and its e8m0 scale bytes
 * as the float32 scales those doubled values take, 2^(e − 128), from their bits (e 0 and 1: the subnormals 2^-128,
 * 2^-127), as llama.cpp's ggml_e8m0_to_fp32_half */
static const int8_t MX4_CODES[16] __attribute__((unused)) = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
static inline float mx4_scale(uint8_t e) {
    uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
#define MX_GROUP 32 /* values an e8m0 scale covers */
static inline void mx4_scales(const uint8_t *e, float *s, int64_t n) {
    for (int64_t i = 0; i < n; i++) s[i] = mx4_scale(e[i]);
}
#if KV_LANES == 16 && defined(__AVX512BW__)
/* 512-bit MXFP4 products take 4 blocks (128 values) a step: step t's 64 code bytes of row r (zeros past the row's
 * `groups` blocks), and its blocks' e8m0 bytes in *e4 (byte k block k's). */
static inline void mx4_step(const uint8_t *r, const uint8_t *e, int64_t t, int64_t groups, __m512i *b, uint32_t *e4) {
    const int64_t nb = groups - 4 * t < 4 ? groups - 4 * t : 4;
    PREFETCH(r + 64 * t);
    *e4 = 0;
    if (nb == 4) {
        *b = _mm512_loadu_si512(r + 64 * t);
        memcpy(e4, e + 4 * t, 4);
    } else {
        *b = _mm512_maskz_loadu_epi8((1ull << (16 * nb)) - 1, r + 64 * t);
        for (int k = 0; k < nb; k++) *e4 |= (uint32_t)e[4 * t + k] << (8 * k);
    }
}
/* Each block's scale over its 128-bit lane, made from its e8m0 byte there: e << 23 is 2^(e − 127) (e = 0: 2^-127),
 * twice mx4_scale's, so a row's sum is halved once at its end. */
static inline __m512 mx4_lane_scales(uint32_t e4) {
    const __m512i lane_byte = _mm512_setr_epi32(0, 0, 0, 0, 8, 8, 8, 8, 16, 16, 16, 16, 24, 24, 24, 24);
    __m512i ev = _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32((int)e4), lane_byte), _mm512_set1_epi32(255));
    return _mm512_castsi512_ps(_mm512_max_epu32(_mm512_slli_epi32(ev, 23), _mm512_set1_epi32(0x00400000)));
}
#endif

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

/* int4 tiles (engine.quant.tile): 16 rows side by side, 8 inputs of each in 4 bytes (tiles.c says why) */
#define TILE_ROWS 16
#define TILE_STEP(i) ((i) / 8 * TILE_ROWS * 4) /* bytes of a tile before the 8-input step holding input i */
/* Several rows of x against one weight matrix (continuous batching): where a product cannot share a weight's
 * conversion among the rows, each row runs the one-row product a chunk of weight rows at a time, about this many
 * bytes a thread, so the chunk is read from the thread's cache for every row after the first. */
#define KV_CHUNK_BYTES (192 * 1024)

/* Storage types to float32 and back, and the rounding of a float32 to a 16-bit type (torch's eager ops
 * round there). */
static inline float f32_id(float f) { return f; }
#define F32_TO(f) (f)
#define BF16_TO(f) f32_to_bf16(f)
#define F16_TO(f) ((_Float16)(f))
static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }
#ifdef __FLT16_MAX__
static inline float f16_to_f32(_Float16 h) { return (float)h; }
static inline float round_f16(float f) { return (float)(_Float16)f; }
#endif

#endif
