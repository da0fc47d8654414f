#include "simd.h"
#include "kernels.h"
#include <stdlib.h>

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
#define RNE (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC) /* a constant expression: clang requires one */
        _mm_storeu_si128((__m128i *)cb, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_div_ps(x0, dv), RNE))));
        _mm_storeu_si128((__m128i *)(cb + 16),
                         _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_div_ps(x1, dv), RNE))));
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
#if KV_LANES == 4 && defined(__ARM_FEATURE_DOTPROD)
#define XQ_ISA "neon-dotprod"
#elif KV_LANES == 4
#define XQ_ISA "neon"
#else
#define XQ_ISA "generic"
#endif
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
#if KV_LANES != 4 /* block b's 32 codes (values, not q + bias) */
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
#endif
#if KV_LANES == 4 /* NEON: a block's 32 codes as two int8 vectors, their sum of products with c in int32 */
static inline int32_t dot32_s8(int8x16_t q0, int8x16_t q1, const int8_t *c) {
    int8x16_t c0 = vld1q_s8(c), c1 = vld1q_s8(c + 16);
#if defined(__ARM_FEATURE_DOTPROD)
    return vaddvq_s32(vdotq_s32(vdotq_s32(vdupq_n_s32(0), q0, c0), q1, c1));
#else /* each 16-bit product widened at once: two of 128 · 127 would overflow a 16-bit sum */
    int32x4_t t = vpaddlq_s16(vmull_s8(vget_low_s8(q0), vget_low_s8(c0)));
    t = vpadalq_s16(t, vmull_s8(vget_high_s8(q0), vget_high_s8(c0)));
    t = vpadalq_s16(t, vmull_s8(vget_low_s8(q1), vget_low_s8(c1)));
    t = vpadalq_s16(t, vmull_s8(vget_high_s8(q1), vget_high_s8(c1)));
    return vaddvq_s32(t);
#endif
}
static inline int32_t block_dot_q8(const int8_t *r, int64_t b, const int8_t *c) {
    PREFETCH(r + b * 32);
    return dot32_s8(vld1q_s8(r + b * 32), vld1q_s8(r + b * 32 + 16), c);
}
static inline int8x16_t sext4(uint8x16_t n) { /* a nibble as int4_value reads it */
    return vsubq_s8(veorq_s8(vreinterpretq_s8_u8(n), vdupq_n_s8(8)), vdupq_n_s8(8));
}
static inline int32_t block_dot_q4(const uint8_t *r, int64_t b, const int8_t *c) {
    PREFETCH(r + b * 16);
    uint8x16_t v = vld1q_u8(r + b * 16);
    int8x16x2_t q = vzipq_s8(sext4(vandq_u8(v, vdupq_n_u8(15))), sext4(vshrq_n_u8(v, 4))); /* inputs 2k, 2k+1 */
    return dot32_s8(q.val[0], q.val[1], c);
}
static inline int32_t block_dot_q5(const uint8_t *r, int64_t b, const int8_t *c) {
    const uint8_t *p = r + b * Q5_BYTES;
    PREFETCH(p);
    static const uint8_t bit[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    uint8x16_t n = vld1q_u8(p + 4), bits = vld1q_u8(bit), sixteen = vdupq_n_u8(16);
    /* the fifth bit of input i is bit i of the block's first 4 bytes: byte i/8 tested against bit i%8 */
    uint8x16_t h0 = vcombine_u8(vdup_n_u8(p[0]), vdup_n_u8(p[1])), h1 = vcombine_u8(vdup_n_u8(p[2]), vdup_n_u8(p[3]));
    uint8x16_t lo = vorrq_u8(vandq_u8(n, vdupq_n_u8(15)), vandq_u8(vtstq_u8(h0, bits), sixteen));
    uint8x16_t hi = vorrq_u8(vshrq_n_u8(n, 4), vandq_u8(vtstq_u8(h1, bits), sixteen));
    return dot32_s8(vsubq_s8(vreinterpretq_s8_u8(lo), vdupq_n_s8(16)), vsubq_s8(vreinterpretq_s8_u8(hi), vdupq_n_s8(16)),
                    c);
}
#define BLOCK_DOT_(K, r, b, c) block_dot_##K(r, b, c)
#else
#define BLOCK_DOT_(K, r, b, c) block_dot_plain(K, r, b, c)
#endif
#define BLOCK_DOT(U, r, b, c) BLOCK_DOT_(U, r, b, c) /* U expanded first: u_q8 -> q8 */
/* block b's 32 codes . c[b's 32 inputs], in int32 */
#define block_dot_plain(U, r, b, c)                                                                              \
    ({                                                                                                          \
        int q_[32];                                                                                             \
        int32_t t_ = 0;                                                                                         \
        block_##U(r, b, q_);                                                                                    \
        for (int i_ = 0; i_ < XQ_BLOCK; i_++) t_ += q_[i_] * (c)[i_];                                            \
        t_;                                                                                                     \
    })
#define INT_ROW(NAME, T, U, SIGNED8, ORDER)                                                                          \
    static float NAME(const T *r, const float *so, int64_t in, int64_t g, const int8_t *c, const int32_t *neg, \
                      const float *d) {                                                                       \
        (void)neg;                                                                                            \
        float a = 0;                                                                                          \
        for (int64_t b = 0; b < in / XQ_BLOCK; b++) {                                                         \
            int32_t t = BLOCK_DOT(U, r, b, c + b * XQ_BLOCK);                                                 \
            a += so[b * XQ_BLOCK / g] * (d[b * 8] * (float)t);                                                \
        }                                                                                                     \
        return a;                                                                                             \
    }
#define u_q8 q8
#define u_q4 q4
#define u_q5 q5
#endif

INT_ROW(int_row_q8, int8_t, u_q8, BIAS8 == 0, ORDER_PLAIN)
INT_ROW(int_row_q4, uint8_t, u_q4, 0, ORDER_Q4)
INT_ROW(int_row_q5, uint8_t, u_q5, 0, ORDER_Q5)

/* y [out] = W x with x quantized as above: codes and scales as the float products take them (mode 8, 4 or 5). */
#define INT_MATVEC(NAME, T, ROW, BIAS, ORDER, BYTES_PER_ROW)                                                         \
    static void NAME(const T *q, const float *s, const float *m, const float *x, float *y, int64_t out, int64_t in, \
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

/* ---- Several rows of x at once with int8 activations (continuous batching's decode steps) ----
 * Each row of x is quantized as the one-row product quantizes it, and each weight step's codes are loaded and
 * unpacked once for up to ROWS_A_PASS rows, each row's lanes then taking exactly the one-row product's
 * instructions in its order: a row's result is its one-row product's, bit for bit, whatever rows run beside it. */
#define ROWS_A_PASS 8
#if INT_TILES
/* Tiles of 16 rows against NR rows of x: the quantized codes c [NR][np/4] (4 a lane), and per row and block of 32
 * its -8 · (codes' sum) and scale; per row its group sums xs (with offsets). y's row k at yk + k · ys. */
static inline __attribute__((always_inline)) void q4tx_tile(const uint8_t *r, const float *st, const float *mt,
                                                            int64_t in, int64_t g, int64_t groups, int NR,
                                                            const int32_t *c, int64_t cs, const int32_t *bneg,
                                                            const float *bd, int64_t bs, const float *xs,
                                                            float *yk, int64_t ys) {
    const int64_t blocks = in / XQ_BLOCK;
    vf acc[ROWS_A_PASS];
    for (int k = 0; k < NR; k++) acc[k] = vzero();
    for (int64_t b = 0; b < blocks; b++) {
        __m512i p[ROWS_A_PASS];
        for (int k = 0; k < NR; k++) p[k] = _mm512_set1_epi32(bneg[k * bs + b]);
        for (int64_t i = b * XQ_BLOCK; i < (b + 1) * XQ_BLOCK; i += 8) {
            const uint8_t *rb = r + TILE_STEP(i);
            PREFETCH(rb);
            __m512i v = _mm512_loadu_si512(rb);
            __m512i lo = LOW_NIBBLES_XOR(v, 8), hi = LOW_NIBBLES_XOR(_mm512_srli_epi32(v, 4), 8);
            for (int k = 0; k < NR; k++) {
                p[k] = _mm512_dpbusd_epi32(p[k], lo, _mm512_set1_epi32(c[k * cs + i / 4]));
                p[k] = _mm512_dpbusd_epi32(p[k], hi, _mm512_set1_epi32(c[k * cs + i / 4 + 1]));
            }
        }
        vf sv = vload(st + b * XQ_BLOCK / g * TILE_ROWS);
        for (int k = 0; k < NR; k++) acc[k] = vfma(_mm512_cvtepi32_ps(p[k]), vmul(sv, vset1(bd[k * bs + b])), acc[k]);
    }
    if (mt)
        for (int k = 0; k < NR; k++)
            for (int64_t j = 0; j < groups; j++) acc[k] = vfma(vload(mt + j * TILE_ROWS), vset1(xs[k * groups + j]), acc[k]);
    for (int k = 0; k < NR; k++) _mm_storeu_acc(yk + k * ys, acc[k]);
}

static int int_matvec_q4t_rows(const uint8_t *q, const float *s, const float *m, const float *x, float *y,
                               int64_t out, int64_t in, int64_t g, int64_t B, int nt) {
    const int64_t np = (in + XQ_PAD - 1) / XQ_PAD * XQ_PAD, groups = in / g, blocks = in / XQ_BLOCK;
    const int64_t tiles = out / TILE_ROWS, cs = np / 4;
    int32_t *c = malloc(sizeof(int32_t) * (size_t)(B * (2 * cs + blocks)));
    float *f = malloc(sizeof(float) * (size_t)(B * (cs + blocks + groups)));
    if (!c || !f) {
        free(c), free(f);
        return 0;
    }
    int32_t *neg = c + B * cs, *bneg = neg + B * cs;
    float *d = f, *bd = d + B * cs, *xs = bd + B * blocks;
    for (int64_t k = 0; k < B; k++) { /* each row as int_matvec_q4t prepares its x */
        quantize_x(x + k * in, in, 8, ORDER_TILES, (int8_t *)(c + k * cs), neg + k * cs, d + k * cs);
        for (int64_t b = 0; b < blocks; b++) {
            int32_t t = 0;
            for (int l = 0; l < XQ_BLOCK / 4; l++) t += neg[k * cs + b * XQ_BLOCK / 4 + l];
            bneg[k * blocks + b] = t;
            bd[k * blocks + b] = d[k * cs + b * XQ_BLOCK / 4];
        }
        if (m) group_sums(x + k * in, xs + k * groups, groups, g);
    }
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const uint8_t *r = q + t * TILE_ROWS * in / 2;
        const float *st = s + t * TILE_ROWS * groups, *mt = m ? m + t * TILE_ROWS * groups : NULL;
        for (int64_t k0 = 0; k0 < B; k0 += ROWS_A_PASS) {
            const int32_t *ck = c + k0 * cs, *nk = bneg + k0 * blocks;
            const float *dk = bd + k0 * blocks, *xk = xs + k0 * groups;
            float *yk = y + k0 * out + t * TILE_ROWS;
            switch (B - k0 < ROWS_A_PASS ? B - k0 : ROWS_A_PASS) { /* a constant NR each: the loops unrolled */
#define Q4TX_CASE(N) \
    case N: q4tx_tile(r, st, mt, in, g, groups, N, ck, cs, nk, dk, blocks, xk, yk, out); break;
                Q4TX_CASE(1) Q4TX_CASE(2) Q4TX_CASE(3) Q4TX_CASE(4) Q4TX_CASE(5) Q4TX_CASE(6) Q4TX_CASE(7)
                default: q4tx_tile(r, st, mt, in, g, groups, ROWS_A_PASS, ck, cs, nk, dk, blocks, xk, yk, out);
#undef Q4TX_CASE
            }
        }
    }
    free(c), free(f);
    return 1;
}
#endif

#if XQ_STEP == 64
/* int8 codes in rows against NR rows of x: each row's lanes as INT_ROW(int_row_q8) computes them. */
static inline __attribute__((always_inline)) void q8x_row(const int8_t *r, const float *so, int64_t in, int64_t g,
                                                          int NR, const int8_t *c, const int32_t *neg,
                                                          const float *d, int64_t cs, float *yk, int64_t ys) {
    __m512 acc[ROWS_A_PASS], acc1[ROWS_A_PASS];
    for (int k = 0; k < NR; k++) acc[k] = acc1[k] = _mm512_setzero_ps();
#define STEP_K(A, i, SCALE) A[k] = dot_step(u, c + k * 4 * cs, neg + k * cs, i, SCALE, A[k])
    if (g % 64 == 0) {
        for (int64_t j = 0; j < in / g; j++) {
            __m512 p0[ROWS_A_PASS], p1[ROWS_A_PASS];
            for (int k = 0; k < NR; k++) p0[k] = p1[k] = _mm512_setzero_ps();
            int64_t i = j * g, end = i + g;
            for (; i + 128 <= end; i += 128) {
                vu u = u_q8(r, i, in);
                for (int k = 0; k < NR; k++) STEP_K(p0, i, _mm512_loadu_ps(d + k * cs + i / 4));
                u = u_q8(r, i + 64, in);
                for (int k = 0; k < NR; k++) STEP_K(p1, i + 64, _mm512_loadu_ps(d + k * cs + (i + 64) / 4));
            }
            if (i < end) {
                vu u = u_q8(r, i, in);
                for (int k = 0; k < NR; k++) STEP_K(p0, i, _mm512_loadu_ps(d + k * cs + i / 4));
            }
            __m512 sj = _mm512_set1_ps(so[j]);
            for (int k = 0; k < NR; k++) acc[k] = _mm512_fmadd_ps(sj, _mm512_add_ps(p0[k], p1[k]), acc[k]);
        }
    } else {
        int64_t i = 0;
        for (; i + 128 <= in; i += 128) {
            vu u = u_q8(r, i, in);
            __m512 sp = scale_pair(so, i, in, g, ORDER_PLAIN);
            for (int k = 0; k < NR; k++) STEP_K(acc, i, _mm512_mul_ps(_mm512_loadu_ps(d + k * cs + i / 4), sp));
            u = u_q8(r, i + 64, in);
            sp = scale_pair(so, i + 64, in, g, ORDER_PLAIN);
            for (int k = 0; k < NR; k++) STEP_K(acc1, i + 64, _mm512_mul_ps(_mm512_loadu_ps(d + k * cs + (i + 64) / 4), sp));
        }
        for (; i < in; i += 64) {
            vu u = u_q8(r, i, in);
            __m512 sp = scale_pair(so, i, in, g, ORDER_PLAIN);
            for (int k = 0; k < NR; k++) STEP_K(acc, i, _mm512_mul_ps(_mm512_loadu_ps(d + k * cs + i / 4), sp));
        }
        for (int k = 0; k < NR; k++) acc[k] = _mm512_add_ps(acc[k], acc1[k]);
    }
#undef STEP_K
    for (int k = 0; k < NR; k++) yk[k * ys] = _mm512_reduce_add_ps(acc[k]);
}

static int int_matvec_q8_rows(const int8_t *q, const float *s, const float *m, const float *x, float *y,
                              int64_t out, int64_t in, int64_t g, int64_t B, int nt) {
    const int64_t np = (in + XQ_PAD - 1) / XQ_PAD * XQ_PAD, groups = in / g, cs = np / 4;
    int8_t *c = malloc((size_t)(B * np));
    int32_t *neg = malloc(sizeof(int32_t) * (size_t)(B * cs));
    float *f = malloc(sizeof(float) * (size_t)(B * (cs + groups)));
    if (!c || !neg || !f) {
        free(c), free(neg), free(f);
        return 0;
    }
    float *d = f, *xs = f + B * cs;
    for (int64_t k = 0; k < B; k++) {
        quantize_x(x + k * in, in, BIAS8, ORDER_PLAIN, c + k * np, neg + k * cs, d + k * cs);
        if (m) group_sums(x + k * in, xs + k * groups, groups, g);
    }
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t o = 0; o < out; o++) {
        const int8_t *r = q + o * in;
        const float *so = s + o * groups;
        for (int64_t k0 = 0; k0 < B; k0 += 4) { /* four rows a pass: two accumulators each, what registers hold */
            const int8_t *ck = c + k0 * np;
            const int32_t *nk = neg + k0 * cs;
            const float *dk = d + k0 * cs;
            float *yk = y + k0 * out + o;
            switch (B - k0 < 4 ? B - k0 : 4) {
            case 1: q8x_row(r, so, in, g, 1, ck, nk, dk, cs, yk, out); break;
            case 2: q8x_row(r, so, in, g, 2, ck, nk, dk, cs, yk, out); break;
            case 3: q8x_row(r, so, in, g, 3, ck, nk, dk, cs, yk, out); break;
            default: q8x_row(r, so, in, g, 4, ck, nk, dk, cs, yk, out);
            }
            if (m)
                for (int64_t k = k0; k < B && k < k0 + 4; k++) y[k * out + o] += dot_f32(m + o * groups, xs + k * groups, groups);
        }
    }
    free(c), free(neg), free(f);
    return 1;
}
#endif

/* The exported products of B rows with int8 activations: each row its kv_matvec_q4tx / kv_matvec_q8x product. */
void kv_matvec_q4tx_rows(const uint8_t *q, const float *s, const float *m, const float *x, float *y, int64_t out,
                         int64_t in, int64_t g, int64_t B, int nt) {
#if INT_TILES
    if (int_products_fit(in, g) && int_matvec_q4t_rows(q, s, m, x, y, out, in, g, B, nt)) return;
#endif
    for (int64_t k = 0; k < B; k++) kv_matvec_q4tx(q, s, m, x + k * in, y + k * out, out, in, g, nt);
}
void kv_matvec_q8x_rows(const int8_t *q, const float *s, const float *m, const float *x, float *y, int64_t out,
                        int64_t in, int64_t g, int64_t B, int nt) {
#if XQ_STEP == 64
    if (int_products_fit(in, g) && int_matvec_q8_rows(q, s, m, x, y, out, in, g, B, nt)) return;
#endif
    for (int64_t k = 0; k < B; k++) kv_matvec_q8x(q, s, m, x + k * in, y + k * out, out, in, g, nt);
}
