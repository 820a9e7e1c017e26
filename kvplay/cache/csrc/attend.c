/* kvplay's fused CPU decode attention: one query token per sequence, read straight from the cache.
 *
 * One layer's history is [ sink (S tokens, 16-bit) | N quantized blocks of T tokens | window (W, 16-bit) ];
 * a plain 16-bit cache is the same with S = N = 0. For every (sequence, KV head) the kernel computes,
 * for its G query heads at once (GQA: each KV row is decoded once and serves all G heads),
 *     out = softmax(scaling * q . k + mask) @ v
 * in float32, without writing any 16-bit copy of the history:
 *   keys, grouped per channel over a block (k = code * scale + zero, one scale/zero per channel per
 *     block): the block's scales are folded into the query (q' = q * scale) and its zero points into one
 *     bias (q . zero), so a score is q' . codes + bias;
 *   values, grouped per token (g codes along head_dim share a scale and zero): each value row is
 *     rebuilt in registers (code * scale + zero, float32) and accumulated for the G heads;
 *   llama.cpp's quantized types (attend_t.kggml, vggml; a layer of llamacpp-* caches: N one-token blocks,
 *     S = W = 0): keys and values grouped per token along head_dim in ggml's 32-element blocks, one float16 d
 *     per block. q8_0 and q4_0, x = d * (code - offset) (q8_0: signed int8 codes, offset 0; q4_0: nibbles,
 *     offset 8): a score is the sum over blocks of d_b * (q_b . (codes_b - offset)) (the offset comes off the
 *     codes in integers: exact, and the same as subtracting offset * d_b * sum(q_b)), a value row is rebuilt
 *     as d * (code - offset), as ggml dequantizes it; AVX2 and AVX-512 rebuild key rows too, and AVX-512 keeps
 *     head_dim-64 rows in registers. q4_1 and q5_1 (d * code + m), q5_0 (5-bit codes, offset 16) and iq4_nl
 *     (d * a 16-entry table) are rebuilt row by row by the portable code on every path (rows rebuilt, then
 *     the vector dot products). No folding: rows are tiled freely, blocks are one token;
 *   rotated caches (stored keys k @ R, values v @ R_v): the quantized part's scores use q @ R, and its value
 *     sum is multiplied by R_v^T once at the end (R_v = R unless attend_t.rot_v is set: llama.cpp rotates K and
 *     V in chunks of different sizes when head_dim is not 64). R is one Hadamard matrix, or one matrix per KV
 *     head (attend_t.rot_h: kvplay's calibrated key rotations), each query head using its KV head's.
 * Work is split into chunks of tokens (blocks for the quantized part) over OpenMP threads; each chunk
 * keeps its own max, sum and accumulator (two passes: scores, then exp and values), merged at the end.
 * Three code paths compute the same sums (in different orders): portable C, AVX2 and AVX-512, chosen at run
 * time from what the CPU has (attend_t.isa pins one, for the tests).
 *
 * One file per instruction set, one translation unit. This file: the job (attend_t), the portable primitives, the chunk
 * loop (CHUNK, written once and instantiated per instruction set with that set's primitives) and the entry
 * point. attend_avx2.h and attend_avx512.h: the x86 primitives, their CHUNK instantiations and (AVX-512) the
 * head_dim-64 register paths (kvplay's layouts, and llama.cpp's q8_0 and q4_0 blocks, up to four query heads
 * per KV head); AVX-512 falls back on AVX2 primitives for shapes it does not cover, so it comes second. They
 * are #included, not built as objects of their own, because no part needs its own compiler
 * flags: each function carries its instruction set in a target attribute, so this one file is compiled once
 * with the plain build flags and picks its path at run time (kernels.py builds one .c file per library; its
 * cache key covers every .h beside it).
 *
 * Code layout (planar packing, as dequant.c): a token's key row is P = D * kbits / 8 bytes, byte i
 * holding channels i, i + P, i + 2P, ... (low bits first); a value row is D / vg groups of
 * vpg = vg * vbits / 8 bytes, planar within each group. 3-bit codes are a bit stream instead (8 codes in 3
 * bytes, quant.pack_bits, in channel order): AVX2 decodes 8 at a time with one variable shift, AVX-512's
 * head_dim-64 path 16 per register. Scales and zeros are float16 bits, or with
 * attend_t.kmeta8 / vmeta8 8-bit codes (a uint8 scale code, an int8 zero: see meta8_scales below).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "half.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) || defined(__i386__)
#define KVPLAY_X86 1      /* attend_avx2.h and attend_avx512.h are compiled in */
#endif

#define MAX_G 16      /* query heads per KV head */
#define MAX_D 256     /* head_dim */
#define TILE 8        /* rows decoded at a time; blocks of quantized tokens are whole tiles (T % 8 == 0) */

typedef struct {
    int64_t B, Hkv, G, D;
    const void *query;               /* (B, Hkv * G, D) in dtype query_dtype, row strides query_b, query_h */
    int query_dtype;                 /* 0 float32, 1 bfloat16, 2 float16 */
    int64_t query_b, query_h;
    float scaling;                   /* scores are (scaling * query) . key */
    const float *q, *q_rot;          /* set by kvplay_attend: scaling * query, and that @ R, float32 */
    const float *rot;                /* (D, D) R (or one per KV head, rot_h), or NULL (no rotation) */
    const float *mask;               /* (B, L) additive float32 (row stride mask_b), or NULL */
    int64_t mask_b;
    int dtype16;                     /* 16-bit parts: 0 float32, 1 bfloat16, 2 float16 */
    const void *sink_k, *sink_v; int64_t S, sink_b, sink_h;      /* rows of D, contiguous per (b, h) */
    const void *win_k, *win_v; int64_t W, win_b, win_h;
    int64_t N, T;                    /* quantized blocks, tokens per block */
    const uint8_t *kp; int64_t kp_b, kp_h;                       /* key codes: row r at kp + r * kP */
    const uint16_t *ks, *kz; int64_t km_b, km_h;                 /* per block: D scales, D zeros */
    int kbits;
    const uint8_t *vp; int64_t vp_b, vp_h;                       /* value codes: row r at vp + r * vP */
    const uint16_t *vs, *vz; int64_t vm_b, vm_h;                 /* per token: D / vg scales, zeros */
    int vbits; int64_t vg;
    void *out;                       /* (B, Hkv * G, D) float32 (out_dtype 0) or bfloat16 (1) */
    int out_dtype;
    int64_t chunk;                   /* tokens per work item */
    int threads;
    int isa;                         /* 0: the best this CPU has; 1 portable C, 2 AVX2, 3 AVX-512 (tests) */
    int kggml, vggml;                /* 0: the layouts above; GGML_*: llama.cpp's blocks (below) */
    const float *rot_v;              /* (D, D) the values' R where it differs from the keys' rot, or NULL (rot) */
    const uint16_t *kmin, *vmin;     /* q4_1, q5_1: per block m, laid out (and strided) as ks, vs */
    const uint8_t *khi, *vhi; int64_t khi_b, khi_h, vhi_b, vhi_h;   /* q5_0, q5_1: 4 bytes of 5th bits per block */
    int kmeta8, vmeta8;              /* 1: ks/kz (vs/vz) hold 8-bit metadata (below), one byte an entry, same strides */
    const float *meta8;              /* 256 float32 scales: table[e] = 2 ** ((e - 176) / 16) (quant._meta8_table) */
    int64_t rot_h;                   /* 0: one rot for every KV head; D * D: rot is (Hkv, D, D), one R per KV head
                                        (kvplay's rotation=calibrated keys; rot_v then falls back on each head's) */
} attend_t;

/* 8-bit metadata (kvplay's kmeta/vmeta=8bit, quant.py's _meta_float): a uint8 scale code e and an int8 zero z,
 * scale = meta8[e], zero = ((float)z * scale) / 8, in float32 as the eager path computes them; the kernel
 * decodes them to float (a block's D key scales and zeros once per block, a value row's groups per row) and
 * then dequantizes with separate products and sums (code * scale, then + zero), as quant.dequantize_int. */
#define META8_ZERO_UNITS 8.f

static inline void meta8_scales(const uint8_t *e, int64_t n, const float *table, float *out) {
    for (int64_t i = 0; i < n; ++i) out[i] = table[e[i]];
}

static inline void meta8_zeros(const uint8_t *e, const int8_t *z, int64_t n, const float *table, float *out) {
    for (int64_t i = 0; i < n; ++i) out[i] = (float)z[i] * table[e[i]] / META8_ZERO_UNITS;
}

/* v[d] = v[d] * s[d / g] + z[d / g] (float scales and zeros; a product, then a sum), group by group: no division
 * per element, and an inner loop the compiler vectorizes (per element, it cost AVX2 value rows 2.7x the time). */
static inline void dequant_float(float *v, const float *s, const float *z, int64_t g, int64_t D) {
    for (int64_t j = 0; j < D / g; ++j) {
        const float sj = s[j], zj = z[j];
        float *w = v + j * g;
        for (int64_t d = 0; d < g; ++d) w[d] = w[d] * sj + zj;
    }
}

/* llama.cpp's types (ggml's 32-element blocks along head_dim, one fp16 d per block, no zero): row r's codes
 * at kp + r * kP (kP = D bytes for q8_0, D / 2 for the others), its D / 32 d's at ks + r * D / 32 (values:
 * vp, vs; kz and vz unused), m's at kmin + r * D / 32, 5th bits at khi + r * D / 8. q8_0: signed int8 codes,
 * x = d * q. The others: byte j of a block holds element j in its low nibble and element j + 16 in its high
 * one (the planar layout of a group of 32 at 4 bits); bit e of the block's 4 qh bytes (little-endian) is
 * element e's 5th bit. q4_0: x = d * (q - 8); q4_1: d * q + m; q5_0: d * (q - 16); q5_1: d * q + m;
 * iq4_nl: d * kvalues_iq4nl[q]. */
#define GGML_Q8_0 1
#define GGML_Q4_0 2
#define GGML_Q4_1 3
#define GGML_Q5_0 4
#define GGML_Q5_1 5
#define GGML_IQ4_NL 6
#define QK 32
static const float kvalues_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

typedef struct { int kind; int64_t from, to, pos; } chunk_t;   /* kind 0 sink, 1 quantized (blocks), 2 window */

/* Element i of a float32 / bfloat16 / float16 array as float. */
static inline float load_float(const void *p, int dtype, int64_t i) {
    if (dtype == 0) return ((const float *)p)[i];
    const uint16_t h = ((const uint16_t *)p)[i];
    return dtype == 1 ? bf16_to_float(h) : half_to_float(h);
}

/* ------------------------------------------------------------------ portable primitives */

/* A 16-bit (or float32) row of D values -> float. */
static inline void row16_generic(const void *src, int64_t r, int dtype, int64_t D, float *out) {
    if (dtype == 0) { memcpy(out, (const float *)src + r * D, D * sizeof(float)); return; }
    const uint16_t *p = (const uint16_t *)src + r * D;
    for (int64_t d = 0; d < D; ++d) out[d] = dtype == 1 ? bf16_to_float(p[d]) : half_to_float(p[d]);
}

/* A row of `groups` groups of g codes (pg bytes each) -> float codes. 2, 4 and 8 bits are planar; 3 bits a
 * little-endian bit stream per group (quant.pack_bits: 8 codes in 3 bytes, the first in the lowest bits; g a
 * multiple of 8), read three bytes at a time. */
static inline void codes_generic(const uint8_t *p, int bits, int64_t g, int64_t groups, float *out) {
    const int64_t pg = (g * bits + 7) / 8;
    const unsigned mask = (1u << bits) - 1u;
    if (bits == 3) {
        for (int64_t j = 0; j < groups; ++j)
            for (int64_t c = 0; c < g; c += 8) {
                const uint8_t *b = p + j * pg + c / 8 * 3;
                const uint32_t w = (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16;
                for (int k = 0; k < 8; ++k) out[j * g + c + k] = (float)((w >> (3 * k)) & 7u);
            }
        return;
    }
    for (int64_t j = 0; j < groups; ++j)
        for (int64_t c = 0; c < g; ++c)
            out[j * g + c] = (float)((p[j * pg + c % pg] >> ((c / pg) * bits)) & mask);
}

/* s[h] = q[h] . row for h < G. */
static inline void dots_generic(const float *q, const float *row, int64_t G, int64_t D, float *s) {
    for (int64_t h = 0; h < G; ++h) {
        float a = 0.f;
        for (int64_t d = 0; d < D; ++d) a += q[h * D + d] * row[d];
        s[h] = a;
    }
}

/* acc[h] += p[h] * row for h < G. */
static inline void axpys_generic(const float *p, const float *row, int64_t G, int64_t D, float *acc) {
    for (int64_t h = 0; h < G; ++h)
        for (int64_t d = 0; d < D; ++d) acc[h * D + d] += p[h] * row[d];
}

/* out[h * stride + t] = q[h] . tile[t] for t < nt rows. */
static inline void dots_tile_generic(const float *q, const float *tile, int64_t nt, int64_t G, int64_t D, float *out,
                                     int64_t stride) {
    float s[MAX_G];
    for (int64_t t = 0; t < nt; ++t) {
        dots_generic(q, tile + t * D, G, D, s);
        for (int64_t h = 0; h < G; ++h) out[h * stride + t] = s[h];
    }
}

/* acc[h] += sum over t < nt of p[h * stride + t] * tile[t]. */
static inline void axpys_tile_generic(const float *p, int64_t stride, const float *tile, int64_t nt, int64_t G,
                                      int64_t D, float *acc) {
    float s[MAX_G];
    for (int64_t t = 0; t < nt; ++t) {
        for (int64_t h = 0; h < G; ++h) s[h] = p[h * stride + t];
        axpys_generic(s, tile + t * D, G, D, acc);
    }
}

/* The largest of x[0 .. n). */
static inline float maxs_generic(const float *x, int64_t n) {
    float m = -INFINITY;
    for (int64_t i = 0; i < n; ++i) m = x[i] > m ? x[i] : m;
    return m;
}

/* x[i] = exp(x[i] - m); returns the sum. */
static inline float exps_generic(float *x, int64_t n, float m) {
    float sum = 0.f;
    for (int64_t i = 0; i < n; ++i) { x[i] = expf(x[i] - m); sum += x[i]; }
    return sum;
}

/* out[i] = float16 bits h[i] as float, i < n. */
static inline void halfs_generic(const uint16_t *h, int64_t n, float *out) {
    for (int64_t i = 0; i < n; ++i) out[i] = half_to_float(h[i]);
}

/* BODY(p, bits, ...) with the usual bit widths as constants: a row's sizes are then shifts, not divisions. */
#define CONST_BITS(BODY, p, bits, ...)                  \
    switch (bits) {                                     \
        case 2: BODY(p, 2, __VA_ARGS__); return;        \
        case 4: BODY(p, 4, __VA_ARGS__); return;        \
        case 8: BODY(p, 8, __VA_ARGS__); return;        \
        default: BODY(p, bits, __VA_ARGS__);            \
    }

/* v[d] = codes[d] * scale[group] + zero[group] in place. */
static inline void dequant_generic(float *v, const uint16_t *s, const uint16_t *z, int64_t g, int64_t D) {
    for (int64_t d = 0; d < D; ++d) v[d] = v[d] * half_to_float(s[d / g]) + half_to_float(z[d / g]);
}

/* A row of `groups` planar groups of g codes -> floats: the codes themselves (s == NULL), or code * scale +
 * zero with each group's float16 scale and zero (s, z). */
static inline void unpack_generic(const uint8_t *p, int bits, int64_t g, int64_t groups, const uint16_t *s,
                                  const uint16_t *z, float *out) {
    codes_generic(p, bits, g, groups, out);
    if (s) dequant_generic(out, s, z, g, g * groups);
}

/* ggml codes of a row of D elements (D / 32 blocks) as floats: q8_0's and q4_0's codes themselves (d == NULL;
 * q4_0's minus 8), or the values with each block's float16 d (and m), computed as ggml.py's dequantize does
 * (d * (code - offset) is exact in float32; d * code + m is a product, then a sum). m, qh: NULL where the
 * type has none. */
static inline void ggml_row_generic(const uint8_t *p, int type, int64_t D, const uint16_t *d, const uint16_t *m,
                                    const uint8_t *qh, float *out) {
    for (int64_t j = 0; j < D / QK; ++j) {
        const float dj = d ? half_to_float(d[j]) : 1.f, mj = m ? half_to_float(m[j]) : 0.f;
        for (int64_t c = 0; c < QK; ++c) {
            if (type == GGML_Q8_0) { out[j * QK + c] = dj * (float)(int8_t)p[j * QK + c]; continue; }
            int code = (p[j * QK / 2 + c % (QK / 2)] >> (c / (QK / 2) * 4)) & 15;
            if (qh) code |= ((qh[j * 4 + c / 8] >> (c % 8)) & 1) << 4;
            float x;
            switch (type) {
                case GGML_Q4_0: x = dj * (float)(code - 8); break;
                case GGML_Q5_0: x = dj * (float)(code - 16); break;
                case GGML_IQ4_NL: x = dj * kvalues_iq4nl[code]; break;
                default: x = (float)code * dj + mj;                  /* q4_1, q5_1 */
            }
            out[j * QK + c] = x;
        }
    }
}

/* Scores of nt ggml key rows (codes at p, P bytes a row; d's at d, D / 32 a row):
 * out[h * stride + t] = sum over blocks j of d_j * (q[h]_j . codes_j); q4_0's offset is in the codes
 * (code - 8), so qsum (the G * D / 32 block sums of q) is not needed here. tile: nt * D floats of scratch. */
static inline void ggml_scores_generic(const float *q, const uint8_t *p, int64_t P, const uint16_t *d,
                                       const uint16_t *m, const uint8_t *qh, int type, int64_t nt, int64_t G,
                                       int64_t D, float *tile, float *out, int64_t stride) {
    if (type != GGML_Q8_0 && type != GGML_Q4_0) {          /* the other types: rows rebuilt, then dot products */
        for (int64_t t = 0; t < nt; ++t)
            ggml_row_generic(p + t * P, type, D, d + t * (D / QK), m ? m + t * (D / QK) : NULL,
                             qh ? qh + t * (D / 8) : NULL, tile + t * D);
        dots_tile_generic(q, tile, nt, G, D, out, stride);
        return;
    }
    for (int64_t t = 0; t < nt; ++t) {
        ggml_row_generic(p + t * P, type, D, NULL, NULL, NULL, tile);
        for (int64_t h = 0; h < G; ++h) {
            float s = 0.f;
            for (int64_t j = 0; j < D / QK; ++j) {
                float a = 0.f;
                for (int64_t c = 0; c < QK; ++c) a += q[h * D + j * QK + c] * tile[j * QK + c];
                s += half_to_float(d[t * (D / QK) + j]) * a;
            }
            out[h * stride + t] = s;
        }
    }
}

/* ggml_scores for an instruction set whose tile dot products are fast: rows rebuilt in float (GROW), then DOTS_T. */
#define GGML_SCORES_VIA_ROWS(NAME, ATTR, GROW, DOTS_T)                                            \
ATTR static inline void NAME(const float *q, const uint8_t *p, int64_t P, const uint16_t *d, const uint16_t *m, \
                             const uint8_t *qh, int type, int64_t nt, int64_t G, int64_t D, float *tile, float *out, \
                             int64_t stride) {                                                    \
    for (int64_t t = 0; t < nt; ++t)                                                              \
        GROW(p + t * P, type, D, d + t * (D / QK), m ? m + t * (D / QK) : NULL, qh ? qh + t * (D / 8) : NULL, \
             tile + t * D);                                                                       \
    DOTS_T(q, tile, nt, G, D, out, stride);                                                       \
}

/* ------------------------------------------------------------------ one chunk of tokens */

/* Scores, max, exp, sum and value accumulation of one chunk for the G heads of (b, kv head hk), TILE rows
 * at a time (rows decoded to float once, then used by every head). res: G maxima, G sums, then G * D
 * accumulators. sc: scratch of G * (chunk tokens) scores, then probabilities. */
#define CHUNK(NAME, ATTR, ROW16, UNPACK, HALFS, DOTS, DOTS_T, AXPYS_T, MAXS, EXPS, GROW, GSCORES)    \
ATTR static void NAME(const attend_t *A, int64_t b, int64_t hk, const chunk_t *c, float *res, float *sc) { \
    const int64_t G = A->G, D = A->D, bh = b * A->Hkv + hk;                                       \
    float *m = res, *l = res + G, *acc = res + 2 * G;                                             \
    float tile[TILE * MAX_D] __attribute__((aligned(32))), qs[MAX_G * MAX_D] __attribute__((aligned(32))); \
    float bias[MAX_G];                                                                            \
    const float *mask = A->mask ? A->mask + b * A->mask_b + c->pos : NULL;                        \
    const float *q = (c->kind == 1 ? A->q_rot : A->q) + bh * G * D;                               \
    const int quant = c->kind == 1, sink = c->kind == 0, size = A->dtype16 ? 2 : 4;               \
    const int gk = quant && A->kggml, gv = quant && A->vggml;     /* llama.cpp's blocks: rows, no folding */ \
    const uint16_t *kmn = gk && A->kmin ? A->kmin + b * A->km_b + hk * A->km_h : NULL;           \
    const uint16_t *vmn = gv && A->vmin ? A->vmin + b * A->vm_b + hk * A->vm_h : NULL;           \
    const uint8_t *khi = gk && A->khi ? A->khi + b * A->khi_b + hk * A->khi_h : NULL;            \
    const uint8_t *vhi = gv && A->vhi ? A->vhi + b * A->vhi_b + hk * A->vhi_h : NULL;            \
    const int64_t n = quant ? (c->to - c->from) * A->T : c->to - c->from;                         \
    const int64_t first = quant ? c->from * A->T : c->from;       /* row index within its segment */ \
    const int64_t kP = (D * A->kbits + 7) / 8, groups = D / A->vg, vP = groups * ((A->vg * A->vbits + 7) / 8); \
    const uint8_t *kp = quant ? A->kp + b * A->kp_b + hk * A->kp_h : NULL;                        \
    const uint8_t *vp = quant ? A->vp + b * A->vp_b + hk * A->vp_h : NULL;                        \
    const uint16_t *ks = quant ? A->ks + b * A->km_b + hk * A->km_h : NULL;                       \
    const uint16_t *kz = quant ? A->kz + b * A->km_b + hk * A->km_h : NULL;                       \
    const uint16_t *vs = quant ? A->vs + b * A->vm_b + hk * A->vm_h : NULL;                       \
    const uint16_t *vz = quant ? A->vz + b * A->vm_b + hk * A->vm_h : NULL;                       \
    const int k8 = quant && !gk && A->kmeta8, v8 = quant && !gv && A->vmeta8;   /* 8-bit metadata: bytes */ \
    const uint8_t *ks8 = k8 ? (const uint8_t *)A->ks + b * A->km_b + hk * A->km_h : NULL;       \
    const int8_t *kz8 = k8 ? (const int8_t *)A->kz + b * A->km_b + hk * A->km_h : NULL;         \
    const uint8_t *vs8 = v8 ? (const uint8_t *)A->vs + b * A->vm_b + hk * A->vm_h : NULL;       \
    const int8_t *vz8 = v8 ? (const int8_t *)A->vz + b * A->vm_b + hk * A->vm_h : NULL;         \
    float vsf[MAX_D], vzf[MAX_D];                                                                 \
    const int64_t off = b * (sink ? A->sink_b : A->win_b) + hk * (sink ? A->sink_h : A->win_h);   \
    const void *K = (const char *)(sink ? A->sink_k : A->win_k) + off * size;                     \
    const void *V = (const char *)(sink ? A->sink_v : A->win_v) + off * size;                     \
    memset(acc, 0, G * D * sizeof(float));                                                        \
    for (int64_t i = 0, nt; i < n; i += nt) {            /* pass 1: scores */                     \
        const int64_t left = quant && !gk ? A->T - i % A->T : n - i;  /* tiles never straddle blocks */ \
        nt = left < TILE ? left : TILE;                                                           \
        const int64_t r = first + i;                                                              \
        if (gk) GSCORES(q, kp + r * kP, kP, ks + r * (D / QK), kmn ? kmn + r * (D / QK) : NULL,  \
                        khi ? khi + r * (D / 8) : NULL, A->kggml, nt, G, D, tile, sc + i, n);      \
        else if (quant && i % A->T == 0) {               /* a new block: fold its scales and zeros */ \
            const int64_t blk = r / A->T;                                                         \
            if (k8) meta8_scales(ks8 + blk * D, D, A->meta8, tile);                               \
            else HALFS(ks + blk * D, D, tile);                                                    \
            for (int64_t h = 0; h < G; ++h)                                                       \
                for (int64_t d = 0; d < D; ++d) qs[h * D + d] = q[h * D + d] * tile[d];           \
            if (k8) meta8_zeros(ks8 + blk * D, kz8 + blk * D, D, A->meta8, tile);                 \
            else HALFS(kz + blk * D, D, tile);                                                    \
            DOTS(q, tile, G, D, bias);                                                            \
        }                                                                                         \
        for (int64_t t = 0; t < nt && !gk; ++t) {                                                 \
            if (quant) UNPACK(kp + (r + t) * kP, A->kbits, D, 1, NULL, NULL, tile + t * D);       \
            else ROW16(K, r + t, A->dtype16, D, tile + t * D);                                    \
        }                                                                                         \
        if (!gk) DOTS_T(quant ? qs : q, tile, nt, G, D, sc + i, n);                               \
        for (int64_t h = 0; h < G; ++h) {  /* separate loops: a vectorized "mask ? mask[i] : 0" becomes */ \
            float *x = sc + h * n + i;     /* a masked load from NULL, a microcode assist per tile */     \
            if (quant && !gk) for (int64_t t = 0; t < nt; ++t) x[t] += bias[h];                   \
            if (mask) for (int64_t t = 0; t < nt; ++t) x[t] += mask[i + t];                       \
        }                                                                                         \
    }                                                                                             \
    for (int64_t h = 0; h < G; ++h) {                                                             \
        m[h] = MAXS(sc + h * n, n);                                                               \
        l[h] = m[h] == -INFINITY ? 0.f : EXPS(sc + h * n, n, m[h]);                              \
        if (m[h] == -INFINITY) memset(sc + h * n, 0, n * sizeof(float));                         \
    }                                                                                             \
    for (int64_t i = 0; i < n; i += TILE) {              /* pass 2: probabilities times values */ \
        const int64_t nt = n - i < TILE ? n - i : TILE, r = first + i;                           \
        for (int64_t t = 0; t < nt; ++t) {                                                        \
            if (gv) GROW(vp + (r + t) * vP, A->vggml, D, vs + (r + t) * (D / QK),                 \
                         vmn ? vmn + (r + t) * (D / QK) : NULL, vhi ? vhi + (r + t) * (D / 8) : NULL, \
                         tile + t * D);                                                           \
            else if (v8) {                                                                        \
                meta8_scales(vs8 + (r + t) * groups, groups, A->meta8, vsf);                      \
                meta8_zeros(vs8 + (r + t) * groups, vz8 + (r + t) * groups, groups, A->meta8, vzf); \
                UNPACK(vp + (r + t) * vP, A->vbits, A->vg, groups, NULL, NULL, tile + t * D);     \
                dequant_float(tile + t * D, vsf, vzf, A->vg, D);                                  \
            }                                                                                     \
            else if (quant) UNPACK(vp + (r + t) * vP, A->vbits, A->vg, groups, vs + (r + t) * groups, \
                                   vz + (r + t) * groups, tile + t * D);                          \
            else ROW16(V, r + t, A->dtype16, D, tile + t * D);                                    \
        }                                                                                         \
        AXPYS_T(sc + i, n, tile, nt, G, D, acc);                                                  \
    }                                                                                             \
}

CHUNK(chunk_generic, , row16_generic, unpack_generic, halfs_generic, dots_generic, dots_tile_generic,
      axpys_tile_generic, maxs_generic, exps_generic, ggml_row_generic, ggml_scores_generic)

#ifdef KVPLAY_X86
#include "attend_avx2.h"
#include "attend_avx512.h"
#endif

/* ------------------------------------------------------------------ entry point */

/* The chunks of one (b, h): sink, blocks, window, each cut into pieces of about `chunk` tokens. */
static int64_t plan(const attend_t *A, chunk_t *c) {
    int64_t n = 0;
    const int64_t per_blocks = A->chunk / A->T > 0 ? A->chunk / A->T : 1;
    const int64_t len[3] = {A->S, A->N, A->W}, step[3] = {A->chunk, per_blocks, A->chunk};
    const int64_t start[3] = {0, A->S, A->S + A->N * A->T};
    for (int kind = 0; kind < 3; ++kind)
        for (int64_t f = 0; f < len[kind]; f += step[kind]) {
            if (c) {
                const int64_t t = f + step[kind] < len[kind] ? f + step[kind] : len[kind];
                c[n] = (chunk_t){kind, f, t, start[kind] + (kind == 1 ? f * A->T : f)};
            }
            ++n;
        }
    return n;
}

/* scaling * query, as float32 (B, Hkv * G, D), and that @ R for the quantized part (the same if no rotation). */
static void queries(const attend_t *A, float *q, float *q_rot) {
    const int64_t H = A->Hkv * A->G, D = A->D;
    for (int64_t b = 0; b < A->B; ++b)
        for (int64_t h = 0; h < H; ++h)
            for (int64_t d = 0; d < D; ++d)
                q[(b * H + h) * D + d] = load_float(A->query, A->query_dtype, b * A->query_b + h * A->query_h + d)
                                         * A->scaling;
    if (!A->rot) return;
    for (int64_t r = 0; r < A->B * H; ++r) {
        const float *R = A->rot + ((r % H) / A->G) * A->rot_h;                    /* the row's KV head's R */
        for (int64_t e = 0; e < D; ++e) {
            float a = 0.f;
            for (int64_t d = 0; d < D; ++d) a += q[r * D + d] * R[d * D + e];          /* (q @ R)[e] */
            q_rot[r * D + e] = a;
        }
    }
}

/* Returns 0, or -1 if a shape is out of range or scratch memory could not be allocated (nothing written). */
int kvplay_attend(const attend_t *job) {
    attend_t J = *job;
    const attend_t *A = &J;
    if (A->G < 1 || A->G > MAX_G || A->D < 1 || A->D > MAX_D || A->T < 1 || A->chunk < 1) return -1;
    if ((A->kmeta8 && (A->kggml || !A->meta8)) || (A->vmeta8 && (A->vggml || !A->meta8))) return -1;
    for (int part = 0; part < 2; ++part) {             /* llama.cpp's blocks: bits, group and pointers follow */
        const int type = part ? A->vggml : A->kggml;
        if (!type) continue;
        const int with_m = type == GGML_Q4_1 || type == GGML_Q5_1, with_qh = type == GGML_Q5_0 || type == GGML_Q5_1;
        if (type < GGML_Q8_0 || type > GGML_IQ4_NL || A->D % QK || with_m != !!(part ? A->vmin : A->kmin)
            || with_qh != !!(part ? A->vhi : A->khi)) return -1;
        if (part) { J.vbits = type == GGML_Q8_0 ? 8 : 4; J.vg = QK; J.vz = J.vs; }
        else { J.kbits = type == GGML_Q8_0 ? 8 : 4; J.kz = J.ks; }
    }
    const int64_t per = plan(A, NULL), bh = A->B * A->Hkv, items = bh * per, G = A->G, D = A->D;
    const int64_t nq = bh * G * D;
    float *qbuf = malloc(2 * nq * sizeof(float));
    if (!qbuf) return -1;
    queries(A, qbuf, qbuf + nq);
    J.q = qbuf;
    J.q_rot = A->rot ? qbuf + nq : qbuf;
    const int64_t width = 2 * G + G * D;                  /* one chunk's result: maxima, sums, accumulators */
    const int64_t longest = A->chunk > (A->chunk / A->T) * A->T ? A->chunk : (A->chunk / A->T) * A->T;
    const int64_t scratch = G * (longest > A->T ? longest : A->T);
    chunk_t *chunks = malloc((per > 0 ? per : 1) * sizeof(chunk_t));
    float *res = malloc((items > 0 ? items : 1) * width * sizeof(float));
    if (!chunks || !res) { free(chunks); free(res); free(qbuf); return -1; }
    plan(A, chunks);
    void (*run)(const attend_t *, int64_t, int64_t, const chunk_t *, float *, float *) = chunk_generic;
#ifdef KVPLAY_X86
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    const int avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
                       && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
    if ((A->isa == 3 && !avx512) || (A->isa == 2 && !avx2)) { free(chunks); free(res); free(qbuf); return -1; }
    if (avx512 && (A->isa == 0 || A->isa == 3)) run = chunk_avx512_q64;
    else if (avx2 && (A->isa == 0 || A->isa == 2)) run = chunk_avx2;
#else
    if (A->isa > 1) { free(chunks); free(res); free(qbuf); return -1; }
#endif
    int failed = 0;
    const int threads = A->threads > 0 ? A->threads : 1;
    (void)threads;
#ifdef _OPENMP
    #pragma omp parallel num_threads(threads) if (items > 1)
#endif
    {
        float *sc = malloc(scratch * sizeof(float));
        if (!sc) {
#ifdef _OPENMP
            #pragma omp atomic write
#endif
            failed = 1;
        }
#ifdef _OPENMP
        #pragma omp for schedule(dynamic)
#endif
        for (int64_t it = 0; it < items; ++it)
            if (sc) run(A, (it / per) / A->Hkv, (it / per) % A->Hkv, &chunks[it % per], res + it * width, sc);
        free(sc);
    }
    if (failed) { free(chunks); free(res); free(qbuf); return -1; }
    /* Merge the chunks of each (b, kv head, query head); the quantized part's sum is un-rotated once. */
    for (int64_t x = 0; x < bh; ++x)
        for (int64_t h = 0; h < G; ++h) {
            float M = -INFINITY, L = 0.f, plain[MAX_D] = {0}, rotated[MAX_D] = {0};
            const float *rot_v = A->rot_v ? A->rot_v : A->rot ? A->rot + (x % A->Hkv) * A->rot_h : NULL;
            for (int64_t k = 0; k < per; ++k) {
                const float mk = res[(x * per + k) * width + h];
                M = mk > M ? mk : M;
            }
            for (int64_t k = 0; k < per; ++k) {
                const float *r = res + (x * per + k) * width;
                if (r[h] == -INFINITY) continue;
                const float w = expf(r[h] - M);
                float *into = chunks[k].kind == 1 && rot_v ? rotated : plain;
                L += w * r[G + h];
                for (int64_t d = 0; d < D; ++d) into[d] += w * r[2 * G + h * D + d];
            }
            if (rot_v)
                for (int64_t e = 0; e < D; ++e) {
                    float a = 0.f;
                    for (int64_t d = 0; d < D; ++d) a += rotated[d] * rot_v[e * D + d];    /* (acc @ R^T)[e] */
                    plain[e] += a;
                }
            const int64_t o = (x * G + h) * D;
            for (int64_t d = 0; d < D; ++d) {
                const float y = L > 0.f ? plain[d] / L : 0.f;
                if (A->out_dtype == 1) ((uint16_t *)A->out)[o + d] = float_to_bf16(y);
                else ((float *)A->out)[o + d] = y;
            }
        }
    free(chunks);
    free(res);
    free(qbuf);
    return 0;
}
