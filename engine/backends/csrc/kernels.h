/* kvchat's CPU kernels: the library's ABI, every exported function and struct, as engine/backends/kernels.py
 * and decode_step.py call them through ctypes (tests/engine_tests/test_kernels.py holds their declarations
 * to this file). Built from this folder's .c files in one compiler call, for this CPU (-march=native).
 *
 * Conventions: weights in their checkpoint layout [out, in]; `nt` is the thread count (torch's OpenMP
 * team); quantized weights are codes with one float32 scale per group of g inputs [out, in/g] and an
 * optional offset per group `m` [out, in/g] (NULL: none), a weight being s·q (+ m); int8 codes [out, in],
 * int4 two a byte, low nibble first [out, in/2] (4-bit two's complement), int5 as a GGUF's Q5 blocks
 * (20 bytes a group of 32), int4 tiles as engine.quant.tile lays them. Activations and outputs of quantized
 * products are float32. */
#ifndef KV_KERNELS_H
#define KV_KERNELS_H

#include <stdint.h>

/* What the kernels were built for: "avx512", "avx2" or "generic"; and what runs the integer products
 * (int8 activations): "avx512-vnni", "avx-vnni", "avx2" or "generic". */
const char *kv_isa(void);
const char *kv_int_isa(void);
int kv_int4_tile_rows(void);     /* rows in an int4 tile where tiles pay (16-lane vectors), else 0 */
int kv_int4_integer_tiles(void); /* 1 where the tiles' integer products run (512-bit VNNI) */
int kv_int8_integer_tiles(void); /* 1 where int8 codes in tiles run with int8 activations (512-bit VNNI) */

/* float_products.c: y [out] = W [out, in] x [in], x and y in W's type */
void kv_matvec_f32(const float *w, const float *x, float *y, int64_t out, int64_t in, int nt);
void kv_matvec_bf16(const uint16_t *w, const uint16_t *x, uint16_t *y, int64_t out, int64_t in, int nt);
void kv_matvec_f32_rows(const float *w, const float *x, int64_t xs, float *y, int64_t ys, int64_t out, int64_t in,
                        int64_t B, int nt); /* x [B, in] (rows xs apart) -> y [B, out] (ys apart), each as f32 */
/* x [B, in] float32 (and xh, the bfloat16 rows xhs apart) -> y [B, out] float32 unrounded, each row as one row's */
void kv_matvec_bf16_rows(const uint16_t *w, const uint16_t *xh, int64_t xhs, const float *x, float *y, int64_t out,
                         int64_t in, int64_t B, int nt);
float kv_read_stream(const float *x, int64_t n, int nt); /* the sum of x [n]: the bench's read roofline */

/* quant_products.c: y [out] = W x with float32 activations; W = s·q (+ m) back as float32 rows [out, in];
 * quantization at load (int8 codes into `codes`, or int4 into `packed`: the other NULL) */
void kv_matvec_q8(const int8_t *q, const float *s, const float *m, const float *x, float *y, int64_t out,
                  int64_t in, int64_t g, int nt);
void kv_matvec_q4(const uint8_t *q, const float *s, const float *m, const float *x, float *y, int64_t out,
                  int64_t in, int64_t g, int nt);
void kv_matvec_q5(const uint8_t *q, const float *s, const float *m, const float *x, float *y, int64_t out,
                  int64_t in, int64_t g, int nt);
void kv_matvec_q8_rows(const int8_t *q, const float *s, const float *m, const float *x, float *y, int64_t out,
                       int64_t in, int64_t g, int64_t B, int nt); /* x [B, in] -> y [B, out], each row as q8 */
void kv_dequant_q8(const int8_t *q, const float *s, const float *m, float *w, int64_t out, int64_t in, int64_t g,
                   int nt);
void kv_dequant_q4(const uint8_t *q, const float *s, const float *m, float *w, int64_t out, int64_t in, int64_t g,
                   int nt);
void kv_dequant_q5(const uint8_t *q, const float *s, const float *m, float *w, int64_t out, int64_t in, int64_t g,
                   int nt);
void kv_quantize(const float *w, int8_t *codes, uint8_t *packed, float *s, int64_t out, int64_t in, int64_t g,
                 int qmax, int nt);
/* mxfp4_products.c: MXFP4 codes two a byte [out, in/2], an e8m0 scale byte per 32 [out, in/32] (m and g unused:
 * the same arguments as the other codes' products) */
void kv_matvec_mx4(const uint8_t *q, const uint8_t *e, const float *m, const float *x, float *y, int64_t out,
                   int64_t in, int64_t g, int nt);
void kv_dequant_mx4(const uint8_t *q, const uint8_t *e, const float *m, float *w, int64_t out, int64_t in, int64_t g,
                    int nt);
void kv_matvec_mx4x(const uint8_t *q, const uint8_t *e, const float *m, const float *x, float *y, int64_t out,
                    int64_t in, int64_t g, int nt); /* (integer_products.c) int8 activations */
/* gguf_rows.c: a GGUF tensor's rows into a product's buffers. The kinds' numbers are engine.weights.gguf_header's
 * GGUF_ROWS (a test holds the two, and the block sizes, equal) */
enum { KV_GGUF_Q4_0, KV_GGUF_Q4_1, KV_GGUF_Q8_0, KV_GGUF_Q4_K, KV_GGUF_Q6_K, KV_GGUF_Q5_K }; /* kv_gguf_rows' kinds */
enum { KV_FORM_INT4, KV_FORM_INT8, KV_FORM_INT5 };                                          /* and forms */
void kv_gguf_rows(const uint8_t *raw, int64_t kind, int64_t n, int64_t nb, const int64_t *order, int64_t r0,
                  int64_t tile, int64_t form, int64_t group, uint8_t *codes, float *scales, float *mins,
                  int nt); /* a GGUF tensor's rows into a product's buffers */

/* tiles.c: int4 codes in tiles of 16 rows */
void kv_matvec_q4t(const uint8_t *q, const float *s, const float *m, const float *x, float *y, int64_t out,
                   int64_t in, int64_t g, int nt);
void kv_dequant_q4t(const uint8_t *q, const float *s, const float *m, float *w, int64_t out, int64_t in, int64_t g,
                    int nt);
void kv_matvec_q4t_rows(const uint8_t *q, const float *s, const float *m, const float *x, float *y, int64_t out,
                        int64_t in, int64_t g, int64_t B, int nt); /* x [B, in] -> y [B, out], each row as q4t */
/* tile_prefill.c: y [M, out] = x [M, in] · Wᵀ of int4 tiles for prefill's many rows (1: done; 0: not run here) */
int kv_gemm_q4t(const uint8_t *q, const float *s, const float *m, const float *x, float *y, int64_t out, int64_t in,
                int64_t g, int64_t M, int nt);

/* integer_products.c: the same products with x quantized to int8 per 32 inputs (engine.quant.integer_product),
 * where the shape is whole blocks; the float32 products otherwise */
void kv_matvec_q8x(const int8_t *q, const float *s, const float *m, const float *x, float *y, int64_t out,
                   int64_t in, int64_t g, int nt);
void kv_matvec_q4x(const uint8_t *q, const float *s, const float *m, const float *x, float *y, int64_t out,
                   int64_t in, int64_t g, int nt);
void kv_matvec_q5x(const uint8_t *q, const float *s, const float *m, const float *x, float *y, int64_t out,
                   int64_t in, int64_t g, int nt);
/* integer_rows.c: int8 codes in rows for several rows of x at once, each row as its one-row product */
void kv_matvec_q8x_rows(const int8_t *q, const float *s, const float *m, const float *x, float *y, int64_t out,
                        int64_t in, int64_t g, int64_t B, int nt); /* x [B, in] -> y [B, out], each row as q8x */
/* integer_tiles.c: int4 tiles (kv_matvec_q4t's layout; the float product where the integer ones do not run) and int8
 * codes in the same tiles (only where kv_int8_integer_tiles) by int8 activations, one row and B rows (each row as
 * its one-row product); the int8 tiles read back as float32 rows */
void kv_matvec_q4tx(const uint8_t *q, const float *s, const float *m, const float *x, float *y, int64_t out,
                    int64_t in, int64_t g, int nt);
void kv_matvec_q4tx_rows(const uint8_t *q, const float *s, const float *m, const float *x, float *y, int64_t out,
                         int64_t in, int64_t g, int64_t B, int nt);
void kv_matvec_q8tx(const int8_t *q, const float *s, const float *m, const float *x, float *y, int64_t out,
                    int64_t in, int64_t g, int nt);
void kv_matvec_q8tx_rows(const int8_t *q, const float *s, const float *m, const float *x, float *y, int64_t out,
                         int64_t in, int64_t g, int64_t B, int nt);
void kv_dequant_q8t(const int8_t *q, const float *s, const float *m, float *w, int64_t out, int64_t in, int64_t g,
                    int nt);

/* A cache's positions in slots: a sequence's own cache holds position j in slot j (table NULL); the block pool
 * (engine/kv_pool.py) holds it in block table[j / KV_BLOCK], KV_BLOCK slots a block, shared by every sequence. */
enum { KV_BLOCK = 16 };
#define KV_SLOT(table, j) ((table) ? (int64_t)(table)[(j) / KV_BLOCK] * KV_BLOCK + (j) % KV_BLOCK : (int64_t)(j))

/* attention.c: RMSNorm of one row; attention of the new position `pos` over keys lo..pos (the packed row
 * qkv [(H + 2 Hkv) d] in; k rotated and v written into the layer's cache kc, vc [Hkv, cap, d], cap slots a head,
 * position j in slot KV_SLOT(tb, j); y [H d] out) */
void kv_rmsnorm_f32(const float *x, const float *w, float *y, int64_t n, float eps);
void kv_rmsnorm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t n, float eps);
/* rows x [rows, n] -> y [rows, n], each row as the one-row norm gives it */
void kv_rmsnorm_rows_f32(const float *x, const float *w, float *y, int64_t rows, int64_t n, float eps, int nt);
void kv_rmsnorm_rows_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t rows, int64_t n, float eps,
                          int nt);
void kv_attend_f32(const float *qkv, const float *cs, const float *sn, const float *qn, const float *kn, float eps,
                   float *kc, float *vc, int64_t cap, int64_t pos, int64_t lo, const int32_t *tb, int64_t H,
                   int64_t Hkv, int64_t d, float scale, const float *sinks, float *y, int nt);
void kv_attend_bf16(const uint16_t *qkv, const uint16_t *cs, const uint16_t *sn, const uint16_t *qn,
                    const uint16_t *kn, float eps, uint16_t *kc, uint16_t *vc, int64_t cap, int64_t pos, int64_t lo,
                    const int32_t *tb, int64_t H, int64_t Hkv, int64_t d, float scale, const float *sinks,
                    uint16_t *y, int nt);

/* decode_step.c: silu over float32 values (the MLP's gate); a decode step's layers in one call. A linear layer, and a block's weights and cache. */
typedef struct {
    const void *w;       /* float weight [out, in] of the model's type, or int8 codes / int4 codes two a byte */
    const float *scales; /* [out, in/group] for codes, NULL for float weights */
    const float *mins;   /* [out, in/group] offsets (weights s·q + m), or NULL */
    const void *bias;    /* [out] of the model's type, or NULL */
    int64_t out, in, group;
    int64_t mode;  /* KV_FLOAT, KV_INT8, KV_INT5 (a GGUF's Q5 blocks), KV_INT4, KV_MXFP4 (scales: e8m0 bytes) */
    int64_t act;   /* codes' products: 0 with float32 activations, 8 with int8 ones (kv_matvec_q8x, ...) */
    int64_t tiles; /* int4 codes in tiles of this many rows (kv_matvec_q4t), 0 in rows */
} kv_linear;
enum { KV_FLOAT = 0, KV_MXFP4 = 3, KV_INT4 = 4, KV_INT5 = 5, KV_INT8 = 8 };

typedef struct {
    const void *attn_norm, *mlp_norm, *q_norm, *k_norm; /* q_norm, k_norm NULL without (Qwen3 has them) */
    kv_linear qkv, o, gate_up, down;
    void *k_cache, *v_cache; /* this layer's [H_kv, cap, d] */
    /* a mixture of experts in place of the MLP (n_experts > 0): the router [E, D] (float weights), each expert's
     * gate_up [2F', D] and down [D, F'] as experts[2e], experts[2e + 1]; top_k chosen per position, their
     * softmax weights renormalised when norm_topk */
    kv_linear router;
    const kv_linear *experts;
    int64_t n_experts, top_k, norm_topk, expert_f;
    /* gpt-oss: each head's sink logit [H] (float32, or NULL), this layer's window (0: every position), the
     * router's k highest logits then their softmax (topk_first), the experts' clamped SwiGLU (limit 0: silu) */
    const float *sinks;
    int64_t window, topk_first;
    float swiglu_limit, swiglu_alpha;
    /* the top_k experts to take in place of the router's own choice (their weights still the router's), or NULL:
     * the load-time check gives the module path's choice, so that a near-tie the two round apart is not read as a
     * wrong step (engine/backends/decode_step.py, step_disagreement) */
    const int32_t *route;
} kv_layer;
enum { KV_MAX_EXPERTS = 512, KV_MAX_TOP_K = 64 }; /* what the one-call step routes (more: the module path) */

void kv_silu_f32(const float *g, float *y, int64_t n);
void kv_silu_mul_rows_f32(const float *gu, float *y, int64_t rows, int64_t F, int nt); /* silu(gate) · up a row */

/* x [D] is the residual stream, updated in place through n_layers blocks at position `pos` (in slot
 * KV_SLOT(tb, pos) of each layer's cache); cs, sn [d] the rotation's row for pos; h, qkv, att, t, gu and fx, fy
 * are scratch rows of the sizes their names imply. */
void kv_decode_layers_f32(const kv_layer *layers, int64_t n_layers, float *x, const float *cs, const float *sn,
                          float eps, float qk_eps, int64_t cap, int64_t pos, int64_t lo, const int32_t *tb, int64_t H,
                          int64_t Hkv, int64_t d, int64_t D, int64_t F, float *h, float *qkv, float *att, float *t,
                          float *gu, float *acc, float *fx, float *fy, int nt);
void kv_decode_layers_bf16(const kv_layer *layers, int64_t n_layers, uint16_t *x, const uint16_t *cs,
                           const uint16_t *sn, float eps, float qk_eps, int64_t cap, int64_t pos, int64_t lo,
                           const int32_t *tb, int64_t H, int64_t Hkv, int64_t d, int64_t D, int64_t F, uint16_t *h,
                           uint16_t *qkv, uint16_t *att, uint16_t *t, uint16_t *gu, uint16_t *acc, float *fx,
                           float *fy, int nt);

/* B sequences' decode steps in one call: x [B, D] (row b at position pos[b], keys lo[b]..pos[b], over the caches
 * kc[b * n_layers + n], vc[...] of layer n, its positions in slots KV_SLOT(tb[b], j)), cs, sn [B, d]; every
 * scratch B rows (t ts apart, gu gs apart).
 * kv_linear_rows: y [B, out] = W x for x [B, in], W read a chunk of rows for all B at a time; fx, fy B rows. */
void kv_decode_batch_f32(const kv_layer *layers, int64_t n_layers, int64_t B, float *x, const float *cs,
                         const float *sn, float eps, float qk_eps, int64_t cap, const int64_t *pos, const int64_t *lo,
                         const int32_t *const *tb, void *const *kc, void *const *vc, int64_t H, int64_t Hkv,
                         int64_t d, int64_t D, int64_t F, int64_t ts, int64_t gs, float *h, float *qkv, float *att,
                         float *t, float *gu, float *acc, float *fx, float *fy, int nt);
void kv_decode_batch_bf16(const kv_layer *layers, int64_t n_layers, int64_t B, uint16_t *x, const uint16_t *cs,
                          const uint16_t *sn, float eps, float qk_eps, int64_t cap, const int64_t *pos,
                          const int64_t *lo, const int32_t *const *tb, void *const *kc, void *const *vc, int64_t H,
                          int64_t Hkv, int64_t d, int64_t D, int64_t F, int64_t ts, int64_t gs, uint16_t *h,
                          uint16_t *qkv, uint16_t *att, uint16_t *t, uint16_t *gu, uint16_t *acc, float *fx,
                          float *fy, int nt);
void kv_linear_rows_f32(const kv_linear *l, int64_t B, const float *x, float *y, float *fx, float *fy, int nt);
void kv_linear_rows_bf16(const kv_linear *l, int64_t B, const uint16_t *x, uint16_t *y, float *fx, float *fy,
                         int nt);

#ifdef __FLT16_MAX__ /* float16 where the compiler has _Float16 */
void kv_matvec_f16(const _Float16 *w, const _Float16 *x, _Float16 *y, int64_t out, int64_t in, int nt);
void kv_matvec_f16_rows(const _Float16 *w, const float *x, float *y, int64_t out, int64_t in, int64_t B, int nt);
void kv_rmsnorm_f16(const _Float16 *x, const _Float16 *w, _Float16 *y, int64_t n, float eps);
void kv_rmsnorm_rows_f16(const _Float16 *x, const _Float16 *w, _Float16 *y, int64_t rows, int64_t n, float eps,
                         int nt);
void kv_attend_f16(const _Float16 *qkv, const _Float16 *cs, const _Float16 *sn, const _Float16 *qn,
                   const _Float16 *kn, float eps, _Float16 *kc, _Float16 *vc, int64_t cap, int64_t pos, int64_t lo,
                   const int32_t *tb, int64_t H, int64_t Hkv, int64_t d, float scale, const float *sinks,
                   _Float16 *y, int nt);
void kv_decode_layers_f16(const kv_layer *layers, int64_t n_layers, _Float16 *x, const _Float16 *cs,
                          const _Float16 *sn, float eps, float qk_eps, int64_t cap, int64_t pos, int64_t lo,
                          const int32_t *tb, int64_t H, int64_t Hkv, int64_t d, int64_t D, int64_t F, _Float16 *h,
                          _Float16 *qkv, _Float16 *att, _Float16 *t, _Float16 *gu, _Float16 *acc, float *fx,
                          float *fy, int nt);
void kv_decode_batch_f16(const kv_layer *layers, int64_t n_layers, int64_t B, _Float16 *x, const _Float16 *cs,
                         const _Float16 *sn, float eps, float qk_eps, int64_t cap, const int64_t *pos,
                         const int64_t *lo, const int32_t *const *tb, void *const *kc, void *const *vc, int64_t H,
                         int64_t Hkv, int64_t d, int64_t D, int64_t F, int64_t ts, int64_t gs, _Float16 *h,
                         _Float16 *qkv, _Float16 *att, _Float16 *t, _Float16 *gu, _Float16 *acc, float *fx,
                         float *fy, int nt);
void kv_linear_rows_f16(const kv_linear *l, int64_t B, const _Float16 *x, _Float16 *y, float *fx, float *fy,
                        int nt);
#endif

#endif
