/* The kernels' own C self-check, for a target this machine cannot load them on (aarch64 under qemu): every
 * kernel runs on the same deterministic inputs and prints its outputs, one line per case:
 *   <case> <n> v0 v1 ... (float32 values, %.9g)
 * Built twice from the same sources, once with the target's vectors (NEON) and once plain C (-DKV_GENERIC),
 * the two outputs are compared case by case by tests/engine_tests/test_kernels.py. Sizes cover the tails:
 * rows of 100 inputs (not a multiple of any vector), groups of 32 and 64, odd row counts. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

static uint32_t seed = 12345u;
static float rnd(void) { /* uniform in [-1, 1): a fixed LCG, the same on every target */
    seed = seed * 1664525u + 1013904223u;
    return (float)((seed >> 8) & 0xffffff) / 8388608.0f - 1.0f;
}
static void fill(float *x, int64_t n, float scale) {
    for (int64_t i = 0; i < n; i++) x[i] = rnd() * scale;
}
static uint8_t rnd_byte(void) { return (uint8_t)(((uint32_t)((rnd() + 1.0f) * 128.0f)) & 255u); }

static void show(const char *name, const float *y, int64_t n) {
    printf("%s %lld", name, (long long)n);
    for (int64_t i = 0; i < n; i++) printf(" %.9g", y[i]);
    printf("\n");
}
static uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#define OUT 19
#define IN 256
#define MAXN 8192

static void float_products(void) {
    static float w[OUT * 100], x[100], y[OUT];
    fill(w, OUT * 100, 1.0f);
    fill(x, 100, 1.0f);
    kv_matvec_f32(w, x, y, OUT, 100, 1);
    show("matvec_f32", y, OUT);
    static uint16_t wb[OUT * 100], xb[100], yb[OUT];
    for (int i = 0; i < OUT * 100; i++) wb[i] = to_bf16(w[i]);
    for (int i = 0; i < 100; i++) xb[i] = to_bf16(x[i]);
    kv_matvec_bf16(wb, xb, yb, OUT, 100, 1);
    for (int i = 0; i < OUT; i++) y[i] = from_bf16(yb[i]);
    show("matvec_bf16", y, OUT);
#ifdef __FLT16_MAX__
    static _Float16 wh[OUT * 100], xh[100], yh[OUT];
    for (int i = 0; i < OUT * 100; i++) wh[i] = (_Float16)w[i];
    for (int i = 0; i < 100; i++) xh[i] = (_Float16)x[i];
    kv_matvec_f16(wh, xh, yh, OUT, 100, 1);
    for (int i = 0; i < OUT; i++) y[i] = (float)yh[i];
    show("matvec_f16", y, OUT);
#endif
}

/* one case: its name (the group and whether offsets are on in it), the call, what it wrote */
#define RUN(label, call, out, n)                                                        \
    do {                                                                                \
        snprintf(name, sizeof name, label "_g%lld%s", (long long)g, o);                 \
        call;                                                                           \
        show(name, out, n);                                                             \
    } while (0)

static void code_products(void) {
    static int8_t q8[OUT * IN];
    static uint8_t q4[OUT * IN / 2], q5[OUT * IN / 32 * 20];
    static float s[OUT * IN / 32], m[OUT * IN / 32], x[IN], y[OUT], w[OUT * IN];
    for (int i = 0; i < OUT * IN; i++) q8[i] = (int8_t)rnd_byte();
    for (int i = 0; i < OUT * IN / 2; i++) q4[i] = rnd_byte();
    for (int i = 0; i < OUT * IN / 32 * 20; i++) q5[i] = rnd_byte();
    fill(x, IN, 2.0f);
    char name[64];
    for (int gi = 0; gi < 2; gi++) {
        int64_t g = gi ? 64 : 32, groups = IN / g;
        fill(s, OUT * groups, 0.05f);
        fill(m, OUT * groups, 0.5f); /* offsets as large as the scaled codes: Q4_1's and K-quants' mins */
        for (int off = 0; off < 2; off++) {
            const float *mm = off ? m : NULL;
            const char *o = off ? "+m" : "";
            RUN("q8", kv_matvec_q8(q8, s, mm, x, y, OUT, IN, g, 1), y, OUT);
            RUN("q4", kv_matvec_q4(q4, s, mm, x, y, OUT, IN, g, 1), y, OUT);
            RUN("q8x", kv_matvec_q8x(q8, s, mm, x, y, OUT, IN, g, 1), y, OUT);
            RUN("q4x", kv_matvec_q4x(q4, s, mm, x, y, OUT, IN, g, 1), y, OUT);
            RUN("dequant_q4", kv_dequant_q4(q4, s, mm, w, OUT, IN, g, 1), w, 3 * IN);
            RUN("dequant_q8", kv_dequant_q8(q8, s, mm, w, OUT, IN, g, 1), w, 3 * IN);
            if (g == 32 && !off) { /* MXFP4: blocks of 32, no offsets; e8m0 scale bytes 2^-18 .. 2^2 and a subnormal */
                static uint8_t e8[OUT * IN / 32];
                for (int i = 0; i < OUT * IN / 32; i++) e8[i] = (uint8_t)(110 + rnd_byte() % 20);
                e8[0] = 1;
                RUN("mx4", kv_matvec_mx4(q4, e8, NULL, x, y, OUT, IN, g, 1), y, OUT);
                RUN("mx4x", kv_matvec_mx4x(q4, e8, NULL, x, y, OUT, IN, g, 1), y, OUT);
                RUN("dequant_mx4", kv_dequant_mx4(q4, e8, NULL, w, OUT, IN, g, 1), w, 3 * IN);
            }
            if (g == 32) { /* int5: a GGUF's Q5 blocks, groups of 32 only */
                RUN("q5", kv_matvec_q5(q5, s, mm, x, y, OUT, IN, g, 1), y, OUT);
                RUN("q5x", kv_matvec_q5x(q5, s, mm, x, y, OUT, IN, g, 1), y, OUT);
                RUN("dequant_q5", kv_dequant_q5(q5, s, mm, w, OUT, IN, g, 1), w, 3 * IN);
            }
        }
    }
    fill(w, OUT * IN, 1.0f);
    kv_quantize(w, q8, NULL, s, OUT, IN, 32, 127, 1);
    for (int i = 0; i < 3 * IN; i++) w[i] = q8[i];
    show("quantize_int8_codes", w, 3 * IN);
    show("quantize_int8_scales", s, OUT * IN / 32);
}

static void attention_and_step(void) {
    enum { H = 4, Hkv = 2, d = 64, cap = 40, D = 64, F = 96 };
    static float qkv[(H + 2 * Hkv) * d], cs[d], sn[d], kc[Hkv * cap * d], vc[Hkv * cap * d], y[H * d], x[D], nw[D];
    fill(qkv, (H + 2 * Hkv) * d, 1.0f);
    for (int i = 0; i < d; i++) cs[i] = cosf(0.1f * i), sn[i] = sinf(0.1f * i);
    fill(kc, Hkv * cap * d, 1.0f);
    fill(vc, Hkv * cap * d, 1.0f);
    for (int lo = 0; lo <= 7; lo += 7) { /* the whole context, and a window from position 7 */
        char name[32];
        snprintf(name, sizeof name, "attend_f32_lo%d", lo);
        kv_attend_f32(qkv, cs, sn, NULL, NULL, 1e-6f, kc, vc, cap, 20, lo, NULL, H, Hkv, d, 0.125f, NULL, y, 1);
        show(name, y, H * d);
    }
    { /* the same position through a block pool: positions 0..47 in blocks 2, 0, 3 of 4 (a table), bit for bit */
        static float pk[Hkv * 64 * d], pv[Hkv * 64 * d], py[H * d];
        const int32_t table[3] = {2, 0, 3};
        fill(pk, Hkv * 64 * d, 1.0f), fill(pv, Hkv * 64 * d, 1.0f);
        for (int h = 0; h < Hkv; h++)
            for (int j = 0; j < cap; j++)
                for (int i = 0; i < d; i++) {
                    int64_t slot = KV_SLOT(table, j);
                    pk[(h * 64 + slot) * d + i] = kc[(h * cap + j) * d + i];
                    pv[(h * 64 + slot) * d + i] = vc[(h * cap + j) * d + i];
                }
        kv_attend_f32(qkv, cs, sn, NULL, NULL, 1e-6f, kc, vc, cap, 20, 0, NULL, H, Hkv, d, 0.125f, NULL, y, 1);
        kv_attend_f32(qkv, cs, sn, NULL, NULL, 1e-6f, pk, pv, 64, 20, 0, table, H, Hkv, d, 0.125f, NULL, py, 1);
        float differ = 0;
        for (int i = 0; i < H * d; i++) differ += py[i] != y[i];
        show("attend_f32_paged_differs", &differ, 1);
    }
    fill(x, D, 3.0f);
    fill(nw, D, 1.0f);
    kv_rmsnorm_f32(x, nw, y, D, 1e-6f);
    show("rmsnorm_f32", y, D);
    static float g[H * d];
    fill(g, H * d, 40.0f); /* e^x near and past both ends of float32's range */
    g[0] = -100.0f, g[1] = 95.0f, g[2] = 0.0f;
    kv_silu_f32(g, y, H * d);
    show("silu_f32", y, H * d);

    /* one decode step through two layers: float32 weights, then int4 codes with offsets */
    static float wqkv[(H + 2 * Hkv) * d * D], wo[D * H * d], wgu[2 * F * D], wdn[D * F];
    static float an[D], mn[D], kc2[2][Hkv * cap * d], vc2[2][Hkv * cap * d];
    static float h[MAXN], q[MAXN], att[MAXN], t[MAXN], gu[MAXN], acc[MAXN], fx[MAXN], fy[MAXN];
    fill(wqkv, sizeof wqkv / 4, 0.2f);
    fill(wo, sizeof wo / 4, 0.2f);
    fill(wgu, sizeof wgu / 4, 0.2f);
    fill(wdn, sizeof wdn / 4, 0.2f);
    for (int i = 0; i < D; i++) an[i] = 1.0f + 0.1f * rnd(), mn[i] = 1.0f + 0.1f * rnd();
    static uint8_t c4[4][2 * F * D / 2];
    static float s4[4][2 * F * D / 32], m4[4][2 * F * D / 32];
    const float *fw[4] = {wqkv, wo, wgu, wdn};
    int64_t outs[4] = {(H + 2 * Hkv) * d, D, 2 * F, D}, ins[4] = {D, H * d, D, F};
    for (int int4 = 0; int4 < 2; int4++) {
        kv_layer layers[2];
        memset(layers, 0, sizeof layers);
        for (int n = 0; n < 2; n++) {
            kv_layer *L = layers + n;
            L->attn_norm = an, L->mlp_norm = mn;
            kv_linear *ls[4] = {&L->qkv, &L->o, &L->gate_up, &L->down};
            for (int k = 0; k < 4; k++) {
                kv_linear *l = ls[k];
                l->out = outs[k], l->in = ins[k];
                if (int4) {
                    kv_quantize(fw[k], NULL, c4[k], s4[k], outs[k], ins[k], 32, 7, 1);
                    fill(m4[k], outs[k] * ins[k] / 32, 0.01f);
                    l->w = c4[k], l->scales = s4[k], l->mins = m4[k], l->group = 32, l->mode = KV_INT4;
                } else {
                    l->w = fw[k], l->mode = KV_FLOAT;
                }
            }
            memcpy(kc2[n], kc, sizeof kc);
            memcpy(vc2[n], vc, sizeof vc);
            L->k_cache = kc2[n], L->v_cache = vc2[n];
        }
        float xs[D];
        seed = 777u;
        fill(xs, D, 1.0f);
        static float kept_k[2][Hkv * cap * d], kept_v[2][Hkv * cap * d];
        memcpy(kept_k, kc2, sizeof kept_k);
        memcpy(kept_v, vc2, sizeof kept_v);
        kv_decode_layers_f32(layers, 2, xs, cs, sn, 1e-6f, 1e-6f, cap, 20, 0, NULL, H, Hkv, d, D, F, h, q, att, t, gu, acc, fx,
                             fy, 1);
        show(int4 ? "decode_step_int4" : "decode_step_f32", xs, D);
        /* the same step for two sequences in one call (the second at position 21, over a cache of its own): the
         * first's output against the step alone, the count of values that differ (0) */
        static float bk[2][2][Hkv * cap * d], bv[2][2][Hkv * cap * d], bx[2 * D], bcs[2 * d], bsn[2 * d];
        for (int b = 0; b < 2; b++) memcpy(bk[b], kept_k, sizeof kept_k), memcpy(bv[b], kept_v, sizeof kept_v);
        void *bkc[4] = {bk[0][0], bk[0][1], bk[1][0], bk[1][1]}, *bvc[4] = {bv[0][0], bv[0][1], bv[1][0], bv[1][1]};
        seed = 777u;
        fill(bx, D, 1.0f);
        fill(bx + D, D, 1.0f);
        memcpy(bcs, cs, sizeof cs), memcpy(bcs + d, cs, sizeof cs), memcpy(bsn, sn, sizeof sn), memcpy(bsn + d, sn, sizeof sn);
        int64_t pos[2] = {20, 21}, lo[2] = {0, 0};
        const int32_t *tbs[2] = {NULL, NULL};
        kv_decode_batch_f32(layers, 2, 2, bx, bcs, bsn, 1e-6f, 1e-6f, cap, pos, lo, tbs, bkc, bvc, H, Hkv, d, D, F, D, 2 * F,
                            h, q, att, t, gu, acc, fx, fy, 1);
        float differ = 0;
        for (int i = 0; i < D; i++) differ += bx[i] != xs[i];
        show(int4 ? "decode_batch_int4_differs" : "decode_batch_f32_differs", &differ, 1);
        show(int4 ? "decode_batch_int4" : "decode_batch_f32", bx, 2 * D);
    }
}

/* several rows of x at once against each row alone: the count of outputs that differ (0), and the outputs */
static void batch_rows(void) {
    static float w[OUT * IN], x[3 * IN], y[3 * OUT], one[OUT], s[OUT * IN / 32], m[OUT * IN / 32];
    static int8_t q8[OUT * IN];
    fill(w, OUT * IN, 1.0f);
    fill(x, 3 * IN, 1.0f);
    for (int i = 0; i < OUT * IN; i++) q8[i] = (int8_t)rnd_byte();
    float differ[7] = {0};
    kv_matvec_f32_rows(w, x, 100, y, OUT, OUT, 100, 3, 1);
    for (int b = 0; b < 3; b++) {
        kv_matvec_f32(w, x + b * 100, one, OUT, 100, 1);
        for (int o = 0; o < OUT; o++) differ[0] += one[o] != y[b * OUT + o];
    }
    show("matvec_f32_rows", y, 3 * OUT);
    /* 16-bit weights: rows of 100 inputs (a tail past every vector step), each row rounded as the one-row product */
    static uint16_t wb[OUT * 100], xb[3 * 100], yb[OUT];
    static float xw[3 * 100];
    for (int i = 0; i < OUT * 100; i++) wb[i] = to_bf16(w[i]);
    for (int i = 0; i < 3 * 100; i++) xw[i] = from_bf16(xb[i] = to_bf16(x[i]));
    kv_matvec_bf16_rows(wb, xb, 100, xw, y, OUT, 100, 3, 1);
    for (int b = 0; b < 3; b++) {
        kv_matvec_bf16(wb, xb + b * 100, yb, OUT, 100, 1);
        for (int o = 0; o < OUT; o++) differ[5] += yb[o] != to_bf16(y[b * OUT + o]);
    }
    show("matvec_bf16_rows", y, 3 * OUT);
#ifdef __FLT16_MAX__
    static _Float16 wh[OUT * 100], xh[3 * 100], yh[OUT];
    for (int i = 0; i < OUT * 100; i++) wh[i] = (_Float16)w[i];
    for (int i = 0; i < 3 * 100; i++) xw[i] = (float)(xh[i] = (_Float16)x[i]);
    kv_matvec_f16_rows(wh, xw, y, OUT, 100, 3, 1);
    for (int b = 0; b < 3; b++) {
        kv_matvec_f16(wh, xh + b * 100, yh, OUT, 100, 1);
        for (int o = 0; o < OUT; o++) differ[6] += yh[o] != (_Float16)y[b * OUT + o];
    }
    show("matvec_f16_rows", y, 3 * OUT);
#endif
    for (int k = 0; k < 4; k++) { /* groups of 32 and 64, with and without offsets */
        int64_t g = k & 1 ? 64 : 32;
        const float *mm = k & 2 ? m : NULL;
        fill(s, OUT * IN / g, 0.05f);
        fill(m, OUT * IN / g, 0.5f);
        kv_matvec_q8_rows(q8, s, mm, x, y, OUT, IN, g, 3, 1);
        for (int b = 0; b < 3; b++) {
            kv_matvec_q8(q8, s, mm, x + b * IN, one, OUT, IN, g, 1);
            for (int o = 0; o < OUT; o++) differ[1 + k] += one[o] != y[b * OUT + o];
        }
    }
    show("matvec_q8_rows", y, 3 * OUT);
    show("rows_differ", differ, 7);
}

int main(void) {
    printf("isa %s int %s\n", kv_isa(), kv_int_isa());
    float_products();
    code_products();
    attention_and_step();
    batch_rows();
    return 0;
}
