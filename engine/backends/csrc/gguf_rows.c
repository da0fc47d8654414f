/* A GGUF tensor's rows written straight from the mapped file into a product's final buffers, at load: the blocks
 * of Q4_0, Q4_1, Q8_0, Q4_K, Q6_K and Q5_K decoded, reordered and recentred in one pass (kv_gguf_rows). */
#include "simd.h"
#include "kernels.h"

/* A little-endian IEEE half -> float32, exactly (subnormals, infinities and NaNs included). */
static inline float half_bits_to_f32(const uint8_t *p) {
    uint32_t h = (uint32_t)p[0] | (uint32_t)p[1] << 8, sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1f,
             man = h & 0x3ffu, bits;
    if (e == 0) {
        float f = (float)man * 0x1p-24f; /* zero or a subnormal: man · 2^-24, exact */
        return sign ? -f : f;
    }
    bits = sign | (e == 31 ? 0x7f800000u | man << 13 : (e + 112) << 23 | man << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Eight bytes, one nibble each in its low half (byte i holds n_i) -> four bytes n_{2j} | n_{2j+1} << 4. */
static inline uint32_t pair_nibbles(uint64_t x) {
    x = (x | x >> 4) & 0x00ff00ff00ff00ffull; /* byte pairs: n_{2j} | n_{2j+1} << 4 in the low byte of each */
    x = (x | x >> 8) & 0x0000ffff0000ffffull;
    return (uint32_t)(x | x >> 16);
}

/* ---- A GGUF tensor's rows straight into a product's final buffers, at load. Source kinds (KV_GGUF_*): Q4_0, Q4_1,
 * Q8_0 (blocks of 32), Q4_K, Q6_K, Q5_K (super-blocks of 256). n rows of nb blocks become rows r0 .. r0 + n of the
 * product's codes, scales and, where `mins` is given, offsets, in the product's form (KV_FORM_*):
 *   int4 (Q4 kinds): two codes a byte, value 2k in byte k's low nibble (code q − 8 as q XOR 8), one scale and
 *     offset per 32; `tile`: rows in the kernels' tiles of that many (engine.quant.tile), 1: rows;
 *   int8: a code a byte as engine.weights.gguf_blocks' decoders give it (Q4 kinds q − 8, Q6_K q − 32, Q5_K q,
 *     Q8_0 as stored), one scale (and offset) per `group` values, a source group's repeated where it is larger;
 *   int5 (Q5_K): per 32 values 4 bytes of fifth bits and 16 of nibbles (engine.quant.unpack_int5), code q − 16.
 * Offsets keep x = s · code + m: a Q4 kind's m + 8 · s, Q5_K's m + 16 · s in int5, rounded once from double;
 * 0 for kinds without. Output row r0 + r reads source row order[r] (NULL: row r), undoing a converter's row
 * permutation in the same pass (engine/BENCHMARKS.md, "Opening a model file"). */
static int64_t gguf_block_bytes(int64_t kind) {
    static const int64_t bytes[] = {18, 20, 34, 144, 210, 176};
    return bytes[kind];
}

/* A block's scales and offsets per group of `gs` values (before recentring): d (Q4_0, Q8_0), d and m (Q4_1),
 * d · sc and −dmin · mn (Q4_K, Q5_K: groups of 32), d · sc (Q6_K, groups of 16). */
static void gguf_block_groups(int64_t kind, const uint8_t *blk, float *sc, float *mn, int *gs) {
    if (kind == KV_GGUF_Q4_K || kind == KV_GGUF_Q5_K) {
        const float d = half_bits_to_f32(blk), dmin = half_bits_to_f32(blk + 2);
        const uint8_t *p = blk + 4;
        for (int j = 0; j < 8; j++) { /* ggml's get_scale_min_k4 */
            int s6, m6;
            if (j < 4) {
                s6 = p[j] & 63;
                m6 = p[j + 4] & 63;
            } else {
                s6 = (p[j + 4] & 0x0F) | ((p[j - 4] >> 6) << 4);
                m6 = (p[j + 4] >> 4) | ((p[j] >> 6) << 4);
            }
            sc[j] = d * (float)s6;
            mn[j] = -(dmin * (float)m6);
        }
        *gs = 32;
        return;
    }
    if (kind == KV_GGUF_Q6_K) {
        const float d = half_bits_to_f32(blk + 208);
        for (int j = 0; j < 16; j++) {
            sc[j] = d * (float)(int8_t)blk[192 + j];
            mn[j] = 0.0f;
        }
        *gs = 16;
        return;
    }
    sc[0] = half_bits_to_f32(blk);
    mn[0] = kind == KV_GGUF_Q4_1 ? half_bits_to_f32(blk + 2) : 0.0f;
    *gs = 32;
}

/* A block's values as the product's int8 codes (centred: Q4 kinds q − 8, Q6_K q − 32, Q8_0 as stored), in ggml's
 * order (dequantize_row_*): loops the compiler vectorizes. */
static void gguf_int8_codes(int64_t kind, const uint8_t *blk, int8_t *out) {
    if (kind == KV_GGUF_Q8_0) {
        memcpy(out, blk + 2, 32);
    } else if (kind == KV_GGUF_Q4_K) { /* 4 chunks of 32 bytes: values 64j + i low, 64j + 32 + i high */
        const uint8_t *q = blk + 16;
        for (int j = 0; j < 4; j++)
            for (int i = 0; i < 32; i++) {
                out[64 * j + i] = (int8_t)((q[32 * j + i] & 0x0F) - 8);
                out[64 * j + 32 + i] = (int8_t)((q[32 * j + i] >> 4) - 8);
            }
    } else if (kind == KV_GGUF_Q5_K) { /* group G: nibbles of chunk G / 2 (low or high), fifth bits: bit G of qh */
        const uint8_t *qh = blk + 16, *ql = blk + 48;
        for (int G = 0; G < 8; G++)
            for (int l = 0; l < 32; l++)
                out[32 * G + l] = (int8_t)(((ql[32 * (G / 2) + l] >> (4 * (G % 2))) & 0x0F) | ((qh[l] >> G) & 1) << 4);
    } else if (kind == KV_GGUF_Q6_K) { /* two halves of 128: 64 bytes of low nibbles, 32 of high pairs */
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = blk + 64 * h, *qh = blk + 128 + 32 * h;
            int8_t *y = out + 128 * h;
            for (int l = 0; l < 32; l++) {
                y[l] = (int8_t)(((ql[l] & 0x0F) | ((qh[l] >> 0) & 3) << 4) - 32);
                y[l + 32] = (int8_t)(((ql[l + 32] & 0x0F) | ((qh[l] >> 2) & 3) << 4) - 32);
                y[l + 64] = (int8_t)(((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4) - 32);
                y[l + 96] = (int8_t)(((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4) - 32);
            }
        }
    } else { /* Q4_0, Q4_1: 16 bytes, values i low, 16 + i high */
        const uint8_t *q = blk + (kind == KV_GGUF_Q4_1 ? 4 : 2);
        for (int i = 0; i < 16; i++) {
            out[i] = (int8_t)((q[i] & 0x0F) - 8);
            out[16 + i] = (int8_t)((q[i] >> 4) - 8);
        }
    }
}

/* Q5_K's group G in the int5 layout: bit l of the first 4 bytes is value l's fifth bit, then byte i holds
 * values i and 16 + i in its low and high nibbles. */
static void gguf_q5k_int5(const uint8_t *blk, int G, uint8_t *out) {
    const uint8_t *qh = blk + 16, *ql = blk + 48 + 32 * (G / 2);
    const int shift = 4 * (G % 2);
    uint32_t fifth = 0;
    for (int l = 0; l < 32; l++) fifth |= (uint32_t)((qh[l] >> G) & 1) << l;
    memcpy(out, &fifth, 4); /* little-endian, as every target of these kernels */
    for (int i = 0; i < 16; i++) out[4 + i] = (uint8_t)(((ql[i] >> shift) & 0x0F) | ((ql[16 + i] >> shift) & 0x0F) << 4);
}

void kv_gguf_rows(const uint8_t *raw, int64_t kind, int64_t n, int64_t nb, const int64_t *order, int64_t r0,
                  int64_t tile, int64_t form, int64_t group, uint8_t *codes, float *scales, float *mins, int nt) {
    const int64_t bytes = gguf_block_bytes(kind), values = kind >= KV_GGUF_Q4_K ? 256 : 32, k_in = nb * values;
    const int64_t row_codes = form == KV_FORM_INT8 ? k_in : form == KV_FORM_INT5 ? k_in / 32 * 20 : k_in / 2;
    const int64_t groups = k_in / group; /* output bytes and groups a row */
    const double centre = form == KV_FORM_INT5                                   ? 16.0
                          : (kind == KV_GGUF_Q4_1 || kind == KV_GGUF_Q4_K) ? 8.0 /* code q − 8 */
                                                                              : 0.0;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *src = raw + (order ? order[r] : r) * nb * bytes;
        const int64_t R = r0 + r, t = R / tile, l = R % tile;
        uint8_t *crow = codes + t * tile * row_codes + l * 4; /* int4: unit u (4 bytes) at crow + u · 4 · tile */
        float *srow = scales + t * tile * groups + l, *mrow = mins ? mins + t * tile * groups + l : NULL;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = src + b * bytes;
            float sc[16], mn[16];
            int gs;
            gguf_block_groups(kind, blk, sc, mn, &gs);
            for (int64_t v = 0; v < values; v += group) { /* the product's groups in this block */
                const int j = (int)(v / gs);
                const int64_t g = (b * values + v) / group;
                srow[g * tile] = sc[j];
                if (mrow) mrow[g * tile] = centre != 0.0 ? (float)((double)mn[j] + centre * (double)sc[j]) : mn[j];
            }
            if (form == KV_FORM_INT8) {
                gguf_int8_codes(kind, blk, (int8_t *)codes + R * row_codes + b * values);
                continue;
            }
            if (form == KV_FORM_INT5) {
                for (int G = 0; G < 8; G++) gguf_q5k_int5(blk, G, codes + R * row_codes + (b * 8 + G) * 20);
                continue;
            }
            /* int4: ggml's nibbles in chunks of h bytes (values 0..h-1 low, h..2h-1 high) -> pairs, XOR 8 */
            const int64_t h = kind == KV_GGUF_Q4_K ? 32 : 16, qs = kind == KV_GGUF_Q4_K ? 16 : bytes - 16;
            const uint8_t *q = blk + qs;
            const int64_t unit0 = b * values / 8; /* 8 values a 4-byte unit */
            for (int64_t c = 0; c < values / 2; c += h)
                for (int64_t k = 0; k < h / 2; k += 4) {
                    uint64_t w;
                    memcpy(&w, q + c + 2 * k, 8);
                    uint32_t lo = pair_nibbles(w & 0x0f0f0f0f0f0f0f0full) ^ 0x88888888u,
                             hi = pair_nibbles((w >> 4) & 0x0f0f0f0f0f0f0f0full) ^ 0x88888888u;
                    memcpy(crow + (unit0 + (c + k) / 4) * 4 * tile, &lo, 4);
                    memcpy(crow + (unit0 + (c + h / 2 + k) / 4) * 4 * tile, &hi, 4);
                }
        }
    }
}
