/* int8 activations' codes, shared by the one-row (integer_products.c) and several-rows (integer_rows.c) integer
 * products: x quantized per block of 32, and each code mode's reader for the instruction set built for. */
#ifndef KV_INTEGER_CODES_H
#define KV_INTEGER_CODES_H

#include "simd.h"
#include "kernels.h"
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
/* MXFP4's codes as the unsigned side of the multiply-adds takes them: simd.h's MX4_CODES + 16 (bias 16, as int5's) */
static const uint8_t MX_CODES_U[16] __attribute__((unused)) = {16, 17, 18, 19, 20, 22, 24, 28, 16, 15, 14, 13, 12, 10, 8, 4};
#define XQ_PAD 64 /* buffers padded (codes 0, lanes 0) to whole 64-input steps */
#define XQ_NP(in) (((in) + XQ_PAD - 1) / XQ_PAD * XQ_PAD) /* a row's codes, padded */

static inline int int_products_fit(int64_t in, int64_t g) { return in % XQ_BLOCK == 0 && g % XQ_BLOCK == 0 && g > 0; }

/* The group of input i, for a row's inputs read in order (i never decreasing): *j and the end of its group *end
 * (start them at 0 and g) walk on past each group i has left, so a block's scale costs no division. */
static inline int64_t group_of(int64_t i, int64_t g, int64_t *j, int64_t *end) {
    while (i >= *end) ++*j, *end += g;
    return *j;
}

/* Where a step's k-th code byte comes from within its 64 inputs: the order in which a mode's reader unpacks
 * them (each 4-byte lane stays inside one block of 32). */
enum { ORDER_PLAIN, ORDER_NIBBLES, ORDER_HALVES, ORDER_TILES, ORDER_BLOCK_NIBBLES };
static inline int order_source(int order, int k) {
    if (order == ORDER_NIBBLES) return k < 32 ? 2 * k : 2 * (k - 32) + 1;       /* low nibbles, then high ones */
    if (order == ORDER_BLOCK_NIBBLES) return (k & 32) + 2 * (k & 15) + ((k >> 4) & 1); /* the same, a block at a time */
    if (order == ORDER_HALVES) return (k & 15) + 32 * ((k >> 4) & 1) + 16 * (k >> 5); /* two int5 blocks' halves */
    if (order == ORDER_TILES) return (k & ~7) + ((k & 7) < 4 ? 2 * (k & 7) : 2 * (k & 3) + 1); /* each 8: even, odd */
    return k;
}

static inline void quantize_x(const float *x, int64_t in, int bias, int order, int8_t *c, int32_t *neg, float *d) {
    int64_t np = XQ_NP(in);
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
static inline vu u_mx4(const uint8_t *r, int64_t i, int64_t in) { /* MXFP4: u_q4's nibbles, each its doubled e2m1 value + 16 */
    PREFETCH(r + i / 2);
    __m256i b = in - i >= 64 ? _mm256_loadu_si256((const __m256i *)(r + i / 2)) : _mm256_maskz_loadu_epi8(0xFFFF, r + i / 2);
    __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(b), _mm256_srli_epi16(b, 4), 1);
    return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)MX_CODES_U)),
                               _mm512_and_si512(z, _mm512_set1_epi8(15)));
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
#define ORDER_Q4 ORDER_NIBBLES /* int4: two blocks a step (integer_products.c, int_row_q4) */
#define ORDER_MX4 ORDER_BLOCK_NIBBLES
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
/* A block's 16 bytes in both 128-bit halves, the high half's shifted down a nibble: its low nibbles (inputs 2k),
 * then its high ones (2k + 1), as ORDER_BLOCK_NIBBLES lays x's codes (MXFP4's reader). */
static inline __m256i block_nibbles(const uint8_t *r, int64_t i) {
    PREFETCH(r + i / 2);
    __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(r + i / 2)));
    return _mm256_and_si256(_mm256_srlv_epi32(b, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), _mm256_set1_epi8(15));
}
static inline vu u_mx4(const uint8_t *r, int64_t i, int64_t in) { /* MXFP4: the nibbles looked up */
    (void)in;
    __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)MX_CODES_U));
    return _mm256_shuffle_epi8(lut, block_nibbles(r, i));
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
/* acc + (the step's int32 lane sums, as float) · d · s (one block a step: one weight scale, one x scale). `ca`: for
 * signed int8 codes (BIAS8 == 0), x's codes' magnitudes |c| (INT_MATVEC lays them after c), which meet q with c's
 * sign (q in -127..127: negated exactly): one vpsignb a block, where |q| against c with q's sign took two; no
 * -bias · sums to add. */
static inline __m256i step_sums8(vu u, const int8_t *c, const int8_t *ca, const int32_t *neg, int64_t i) {
    __m256i cv = _mm256_loadu_si256((const __m256i *)(c + i));
    if (ca)
        return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i *)(ca + i)), _mm256_sign_epi8(u, cv)),
                                 _mm256_set1_epi16(1));
    return DPBUSD(_mm256_loadu_si256((const __m256i *)(neg + i / 4)), u, cv);
}
static inline __m256 dot_step8(vu u, const int8_t *c, const int8_t *ca, const int32_t *neg, int64_t i, const float *d,
                               float s, __m256 acc) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(step_sums8(u, c, ca, neg, i)), _mm256_set1_ps(d[i / 4] * s), acc);
}
/* acc + the step's lane sums · x's scale of each lane (its block's, `d` a lane): the weight scale left to the group's
 * end, so a step of a group of whole steps costs no scalar work. */
static inline __m256 dot_lanes8(vu u, const int8_t *c, const int8_t *ca, const int32_t *neg, int64_t i, const float *d,
                                __m256 acc) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(step_sums8(u, c, ca, neg, i)), _mm256_loadu_ps(d + i / 4), acc);
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
#ifndef ORDER_MX4
#define ORDER_MX4 ORDER_Q4
#endif

/* The int4 tiles' integer products (kv_matvec_q4tx) run where 512-bit VNNI does. */
#if KV_LANES == 16 && defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define INT_TILES 1
#else
#define INT_TILES 0
#endif

#endif
