#include "integer_codes.h"

/* ---- One row's integer products (int8 activations); codes in tiles: integer_tiles.c ---- */

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
/* NR rows (1 or 2: r, r + rb; their scales so, so + groups) against x's codes: x's codes, magnitudes and scales
 * loaded once a step for all of them, a short row's fixed costs shared, and each row's chains taking the same
 * operations in the same order whatever NR is, so a row's result is the same bits alone or beside another. */
#define INT_ROWS_N(NAME, T, U, SIGNED8)                                                                              \
    static inline __attribute__((always_inline)) void NAME(const T *r, int64_t rb, const float *so, int64_t groups, \
                                                           int64_t in, int64_t g, const int8_t *c, const int32_t *neg, \
                                                           const float *d, float *y, const int NR) {             \
        __m256 a0[2], a1[2];                                                                                  \
        for (int w = 0; w < NR; w++) a0[w] = a1[w] = _mm256_setzero_ps();                                     \
        int64_t i = 0, j = 0, end = g; /* group_of's walk */                                                   \
        const int8_t *ca = SIGNED8 ? c + XQ_NP(in) : NULL; /* |c|, after c (INT_MATVEC) */                     \
        const int blocks = g == XQ_BLOCK; /* a GGUF's blocks: two a step */                                   \
        if (g % 64 == 0) { /* whole steps a group (one scale a row included): x's scales a lane, s once a group */ \
            for (int64_t k = 0; k < in / g; k++) {                                                            \
                __m256 p0[2], p1[2];                                                                          \
                for (int w = 0; w < NR; w++) p0[w] = p1[w] = _mm256_setzero_ps();                             \
                for (const int64_t e = i + g; i < e; i += 64) {                                               \
                    for (int w = 0; w < NR; w++) p0[w] = dot_lanes8(U(r + w * rb, i, in), c, ca, neg, i, d, p0[w]); \
                    for (int w = 0; w < NR; w++)                                                              \
                        p1[w] = dot_lanes8(U(r + w * rb, i + 32, in), c, ca, neg, i + 32, d, p1[w]);          \
                }                                                                                             \
                for (int w = 0; w < NR; w++)                                                                  \
                    a0[w] = _mm256_fmadd_ps(_mm256_set1_ps(so[w * groups + k]), _mm256_add_ps(p0[w], p1[w]), a0[w]); \
            }                                                                                                 \
            for (int w = 0; w < NR; w++) y[w] = kv_hsum256(a0[w]);                                            \
            return;                                                                                           \
        }                                                                                                     \
        for (; i + 64 <= in; i += 64) {                                                                       \
            const int64_t k0 = blocks ? i >> 5 : group_of(i, g, &j, &end);                                    \
            const int64_t k1 = blocks ? (i >> 5) + 1 : group_of(i + 32, g, &j, &end);                         \
            for (int w = 0; w < NR; w++)                                                                      \
                a0[w] = dot_step8(U(r + w * rb, i, in), c, ca, neg, i, d, so[w * groups + k0], a0[w]);        \
            for (int w = 0; w < NR; w++)                                                                      \
                a1[w] = dot_step8(U(r + w * rb, i + 32, in), c, ca, neg, i + 32, d, so[w * groups + k1], a1[w]); \
        }                                                                                                     \
        if (i < in) {                                                                                         \
            const int64_t k = group_of(i, g, &j, &end);                                                       \
            for (int w = 0; w < NR; w++)                                                                      \
                a0[w] = dot_step8(U(r + w * rb, i, in), c, ca, neg, i, d, so[w * groups + k], a0[w]);         \
        }                                                                                                     \
        for (int w = 0; w < NR; w++) y[w] = kv_hsum256(_mm256_add_ps(a0[w], a1[w]));                          \
    }
/* A row alone (NAME) and two at once (INT_ROWS2's), both through NAME##_n. */
#define INT_ROW(NAME, T, U, SIGNED8, ORDER)                                                                          \
    INT_ROWS_N(NAME##_n, T, U, SIGNED8)                                                                       \
    static float NAME(const T *r, const float *so, int64_t in, int64_t g, const int8_t *c, const int32_t *neg, \
                      const float *d) {                                                                       \
        float y;                                                                                              \
        NAME##_n(r, 0, so, 0, in, g, c, neg, d, &y, 1);                                                       \
        return y;                                                                                             \
    }
#define INT_ROWS2(NAME, T, U, SIGNED8, ROW)                                                                          \
    static void NAME(const T *r, int64_t rb, const float *so, int64_t groups, int64_t in, int64_t g,            \
                     const int8_t *c, const int32_t *neg, const float *d, float *y) {                           \
        ROW##_n(r, rb, so, groups, in, g, c, neg, d, y, 2);                                                   \
    }
#else /* plain C: the same integer sums, a block at a time */
#if KV_LANES != 4 /* block b's 32 codes (values, not q + bias) */
static inline void block_q8(const int8_t *r, int64_t b, int q[32]) {
    for (int i = 0; i < 32; i++) q[i] = r[b * 32 + i];
}
static inline void block_q4(const uint8_t *r, int64_t b, int q[32]) {
    for (int i = 0; i < 16; i++) q[2 * i] = int4_value(r[b * 16 + i]), q[2 * i + 1] = int4_value(r[b * 16 + i] >> 4);
}
static inline void block_mx4(const uint8_t *r, int64_t b, int q[32]) {
    for (int i = 0; i < 16; i++) q[2 * i] = MX4_CODES[r[b * 16 + i] & 15], q[2 * i + 1] = MX4_CODES[r[b * 16 + i] >> 4];
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
static inline int32_t block_dot_mx4(const uint8_t *r, int64_t b, const int8_t *c) {
    PREFETCH(r + b * 16);
    uint8x16_t v = vld1q_u8(r + b * 16);
    int8x16_t lut = vld1q_s8(MX4_CODES);
    int8x16x2_t q = vzipq_s8(vqtbl1q_s8(lut, vandq_u8(v, vdupq_n_u8(15))), vqtbl1q_s8(lut, vshrq_n_u8(v, 4)));
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
        int64_t j = 0, end = g; /* group_of's walk */                                                         \
        for (int64_t b = 0; b < in / XQ_BLOCK; b++) {                                                         \
            int32_t t = BLOCK_DOT(U, r, b, c + b * XQ_BLOCK);                                                 \
            a += so[group_of(b * XQ_BLOCK, g, &j, &end)] * (d[b * 8] * (float)t);                             \
        }                                                                                                     \
        return a;                                                                                             \
    }
#define u_q8 q8
#define u_q4 q4
#define u_q5 q5
#define u_mx4 mx4
#endif

#if XQ_STEP != 32 /* a pair of rows is two rows (the two-row products are AVX2's) */
#define INT_ROWS2(NAME, T, U, SIGNED8, ROW)                                                                          \
    static void NAME(const T *r, int64_t rb, const float *so, int64_t groups, int64_t in, int64_t g,            \
                     const int8_t *c, const int32_t *neg, const float *d, float *y) {                           \
        y[0] = ROW(r, so, in, g, c, neg, d), y[1] = ROW(r + rb, so + groups, in, g, c, neg, d);                 \
    }
#endif
INT_ROW(int_row_q8, int8_t, u_q8, BIAS8 == 0, ORDER_PLAIN)
INT_ROWS2(int_rows2_q8, int8_t, u_q8, BIAS8 == 0, int_row_q8)
#if XQ_STEP == 32
/* Step i's lane sums for a row r of int4 codes against x's codes ce (even inputs) and co (odd ones) from `start`
 * (the lanes' -8 · code sums): exact in int32. `two`: the step holds two blocks, else its second is the row's end. */
static inline __attribute__((always_inline)) __m256i q4_step_sums(const uint8_t *r, int64_t i, int two, __m256i ce,
                                                                 __m256i co, __m256i start) {
    const __m256i low = _mm256_set1_epi8(15), flip = _mm256_set1_epi8((char)0x88);
    PREFETCH(r + i / 2);
    __m256i b = two ? _mm256_loadu_si256((const __m256i *)(r + i / 2))
                    : _mm256_inserti128_si256(_mm256_setzero_si256(), _mm_loadu_si128((const __m128i *)(r + i / 2)), 0);
    b = _mm256_xor_si256(b, flip); /* 4-bit two's complement q -> q + 8, both nibbles */
    __m256i lo = _mm256_and_si256(b, low), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
#if BIAS8 /* AVX-VNNI: four codes a lane a multiply-add */
    return DPBUSD(DPBUSD(start, lo, ce), hi, co);
#else
    return _mm256_add_epi32(
        _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, ce), _mm256_maddubs_epi16(hi, co)), _mm256_set1_epi16(1)),
        start);
#endif
}
/* int4 on AVX2: a step of 64 inputs (two blocks) from one 32-byte load, its low nibbles (the step's even inputs) and
 * high ones (its odd inputs) against x's codes in ORDER_NIBBLES. Without VNNI each half's multiply-add pairs are
 * summed in 16 bits (at most 2 · 2 · 15 · 127: exact) before one vpmaddwd, so a step of 64 weights costs about 14
 * vector operations where a block at a time cost about 22 (with AVX-VNNI, two vpdpbusd); each 128-bit lane is one
 * block (lanes 0-3 block one, 4-7 block two) and takes its scale.
 * A row of in % 64 == 32 ends on one block: its 16 bytes alone, the second block's codes 0 and scales 0.
 * NR rows (1 or 2) a pass, as INT_ROWS_N: a row of int4 codes is short in bytes (896 inputs: 14 steps), so x's
 * codes, sums and scales are loaded once a step for both, each row's chains the same operations in the same order. */
static inline __attribute__((always_inline)) void q4_rows(const uint8_t *r, int64_t rb, const float *so,
                                                          int64_t groups, int64_t in, int64_t g, const int8_t *c,
                                                          const int32_t *neg, const float *d, float *y, const int NR) {
    __m256 a0[2], a1[2];
    for (int w = 0; w < NR; w++) a0[w] = a1[w] = _mm256_setzero_ps();
    int64_t j = 0, end = g; /* group_of's walk */
    for (int64_t i = 0; i < in; i += 64) {
        const int two = in - i >= 64;
        const __m256i ce = _mm256_loadu_si256((const __m256i *)(c + i)), co = _mm256_loadu_si256((const __m256i *)(c + i + 32));
        const __m256i start = _mm256_add_epi32(_mm256_loadu_si256((const __m256i *)(neg + i / 4)),
                                               _mm256_loadu_si256((const __m256i *)(neg + i / 4 + 8)));
        const __m256 dv = _mm256_loadu_ps(d + i / 4);
        const int64_t k0 = group_of(i, g, &j, &end), k1 = two ? group_of(i + 32, g, &j, &end) : 0;
        for (int w = 0; w < NR; w++) {
            const __m256i p = q4_step_sums(r + w * rb, i, two, ce, co, start);
            const float s0 = so[w * groups + k0], s1 = two ? so[w * groups + k1] : 0.0f;
            const __m256 f = _mm256_mul_ps(dv, _mm256_blend_ps(_mm256_set1_ps(s0), _mm256_set1_ps(s1), 0xF0));
            if (i & 64) a1[w] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), f, a1[w]);
            else a0[w] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), f, a0[w]);
        }
    }
    for (int w = 0; w < NR; w++) y[w] = kv_hsum256(_mm256_add_ps(a0[w], a1[w]));
}
static float int_row_q4(const uint8_t *r, const float *so, int64_t in, int64_t g, const int8_t *c, const int32_t *neg,
                        const float *d) {
    float y;
    q4_rows(r, 0, so, 0, in, g, c, neg, d, &y, 1);
    return y;
}
static void int_rows2_q4(const uint8_t *r, int64_t rb, const float *so, int64_t groups, int64_t in, int64_t g,
                         const int8_t *c, const int32_t *neg, const float *d, float *y) {
    q4_rows(r, rb, so, groups, in, g, c, neg, d, y, 2);
}
#else
INT_ROW(int_row_q4, uint8_t, u_q4, 0, ORDER_Q4)
INT_ROWS2(int_rows2_q4, uint8_t, u_q4, 0, int_row_q4)
#endif
INT_ROW(int_row_q5, uint8_t, u_q5, 0, ORDER_Q5)
INT_ROWS2(int_rows2_q5, uint8_t, u_q5, 0, int_row_q5)
#if XQ_STEP != 64 /* (512-bit VNNI has its own MXFP4 product below) */
INT_ROW(int_row_mx4, uint8_t, u_mx4, 0, ORDER_MX4)
#endif

/* y [out] = W x with x quantized as above: codes and scales as the float products take them (mode 8, 4 or 5); rows
 * two a pass (ROWS2), the last of an odd count alone (ROW): the same bits either way. */
#define INT_MATVEC(NAME, T, ROW, ROWS2, BIAS, ORDER, BYTES_PER_ROW)                                                  \
    static void NAME(const T *q, const float *s, const float *m, const float *x, float *y, int64_t out, int64_t in, \
              int64_t g, int nt) {                                                                            \
        int64_t np = XQ_NP(in), groups = in / g, rb = BYTES_PER_ROW;                                          \
        int8_t c[2 * np]; /* x's codes, then (signed int8 codes on AVX2: dot_step8) their magnitudes */       \
        int32_t neg[np / 4];                                                                                  \
        float d[np / 4], xs[groups];                                                                          \
        quantize_x(x, in, BIAS, ORDER, c, neg, d);                                                                \
        if (XQ_STEP == 32 && (BIAS) == 0)                                                                     \
            for (int64_t k = 0; k < np; k++) c[np + k] = (int8_t)(c[k] < 0 ? -c[k] : c[k]);                   \
        if (m) group_sums(x, xs, groups, g);                                                                  \
        _Pragma("omp parallel for num_threads(nt) schedule(static)")                                          \
        for (int64_t o = 0; o < out; o += 2) {                                                                \
            if (o + 1 < out) ROWS2(q + o * rb, rb, s + o * groups, groups, in, g, c, neg, d, y + o);          \
            else y[o] = ROW(q + o * rb, s + o * groups, in, g, c, neg, d);                                    \
            for (int64_t w = o; m && w < out && w < o + 2; w++) y[w] += dot_f32(m + w * groups, xs, groups);  \
        }                                                                                                     \
    }
INT_MATVEC(int_matvec_q8, int8_t, int_row_q8, int_rows2_q8, BIAS8, ORDER_PLAIN, in)
INT_MATVEC(int_matvec_q4, uint8_t, int_row_q4, int_rows2_q4, 8, ORDER_Q4, in / 2)
INT_MATVEC(int_matvec_q5, uint8_t, int_row_q5, int_rows2_q5, 16, ORDER_Q5, in / 32 * 20)
#if XQ_STEP == 64
/* MXFP4 where 512-bit VNNI runs: a 64-byte load holds 4 blocks (128 inputs), its low nibbles looked up as the
 * values + 16 (vpshufb) meet x's codes of the even inputs, its high ones the odd ones, each 32-bit lane eight
 * inputs of one block (each 128-bit lane one block) starting from −16 · their codes' sum; each block's scale is
 * made in its lane (mx4_lane_scales) times x's d, with no pass over a row's scales first. x's codes, sums and
 * scales are laid out so once a call. */
static void int_matvec_mx4(const uint8_t *q, const uint8_t *e, const float *x, float *y, int64_t out, int64_t in,
                           int nt) {
    const int64_t groups = in / 32, steps = (in + 127) / 128, np = steps * 128;
    int8_t natural[np], c[np]; /* x's codes as quantize_x gives them; c: each step's evens, then its odds */
    int32_t unused[np / 4], neg[steps * 16];
    float d4[np / 4], d[steps * 16];
    const int64_t padded = XQ_NP(in); /* what quantize_x fills; zeros past it */
    quantize_x(x, in, 0, ORDER_PLAIN, natural, unused, d4);
    memset(natural + padded, 0, np - padded);
    for (int64_t i = padded / 4; i < np / 4; i++) d4[i] = 0;
    for (int64_t t = 0; t < steps; t++) {
        int8_t *ct = c + 128 * t;
        const int8_t *xt = natural + 128 * t;
        for (int k = 0; k < 64; k++) ct[k] = xt[2 * k], ct[64 + k] = xt[2 * k + 1];
        for (int l = 0; l < 16; l++) { /* lane l: inputs 8l..8l+7 of the step, block l / 4 */
            int32_t sum = 0;
            for (int j = 0; j < 8; j++) sum += xt[8 * l + j];
            neg[16 * t + l] = -16 * sum;
            d[16 * t + l] = d4[(128 * t + 8 * l) / 4];
        }
    }
    const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)MX_CODES_U));
    const __m512i low = _mm512_set1_epi8(15);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t o = 0; o < out; o++) {
        const uint8_t *r = q + o * (in / 2), *eo = e + o * groups;
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
        for (int64_t t = 0; t < steps; t++) {
            uint32_t e4;
            __m512i b;
            mx4_step(r, eo, t, groups, &b, &e4);
            __m512i evens = _mm512_shuffle_epi8(table, _mm512_and_si512(b, low));
            __m512i odds = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(b, 4), low));
            __m512i p = _mm512_dpbusd_epi32(_mm512_loadu_si512(neg + 16 * t), evens, _mm512_loadu_si512(c + 128 * t));
            p = _mm512_dpbusd_epi32(p, odds, _mm512_loadu_si512(c + 128 * t + 64));
            const __m512 s = _mm512_mul_ps(mx4_lane_scales(e4), _mm512_loadu_ps(d + 16 * t));
            if (t & 1) a1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), s, a1);
            else a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), s, a0);
        }
        y[o] = 0.5f * _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    }
}
#else
/* MXFP4: each row's e8m0 scales made float32 as it is reached (mx4_scales), never a float copy of them all */
static void int_matvec_mx4(const uint8_t *q, const uint8_t *e, const float *x, float *y, int64_t out, int64_t in,
                           int nt) {
    int64_t np = XQ_NP(in), groups = in / 32;
    int8_t c[np];
    int32_t neg[np / 4];
    float d[np / 4];
    quantize_x(x, in, 16, ORDER_MX4, c, neg, d);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t o = 0; o < out; o++) {
        float so[groups];
        mx4_scales(e + o * groups, so, groups);
        y[o] = int_row_mx4(q + o * (in / 2), so, in, 32, c, neg, d);
    }
}
#endif

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
void kv_matvec_mx4x(const uint8_t *q, const uint8_t *e, const float *m, const float *x, float *y, int64_t out,
                    int64_t in, int64_t g, int nt) {
    (void)g, (void)m; /* blocks of 32, no offsets */
    int_matvec_mx4(q, e, x, y, out, in, nt);
}
const char *kv_int_isa(void) { return XQ_ISA; }
