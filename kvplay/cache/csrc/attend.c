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
 *   Hadamard-rotated caches (stored keys k @ R, values v @ R): the quantized part's scores use q @ R,
 *     and its value sum is multiplied by R^T once at the end.
 * Work is split into chunks of tokens (blocks for the quantized part) over OpenMP threads; each chunk
 * keeps its own max, sum and accumulator (two passes: scores, then exp and values), merged at the end.
 * Three code paths compute the same sums (in different orders): portable C, AVX2 and AVX-512, chosen at run
 * time from what the CPU has (attend_t.isa pins one, for the tests).
 *
 * Code layout (planar packing, as dequant.c): a token's key row is P = D * kbits / 8 bytes, byte i
 * holding channels i, i + P, i + 2P, ... (low bits first); a value row is D / vg groups of
 * vpg = vg * vbits / 8 bytes, planar within each group. Scales and zeros are float16 bits.
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
#include <immintrin.h>
#define KVPLAY_X86 1
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
    const float *rot;                /* (D, D) R, or NULL (no rotation) */
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
} attend_t;

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

/* A row of `groups` planar groups of g codes (pg bytes each) -> float codes. */
static inline void codes_generic(const uint8_t *p, int bits, int64_t g, int64_t groups, float *out) {
    const int64_t pg = (g * bits + 7) / 8;
    const unsigned mask = (1u << bits) - 1u;
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

/* ------------------------------------------------------------------ AVX2 primitives */
#ifdef KVPLAY_X86
#define AVX2 __attribute__((target("avx2,fma,f16c")))

AVX2 static inline void row16_avx2(const void *src, int64_t r, int dtype, int64_t D, float *out) {
    if (dtype == 0 || D % 8) { row16_generic(src, r, dtype, D, out); return; }
    const uint16_t *p = (const uint16_t *)src + r * D;
    for (int64_t d = 0; d < D; d += 8) {
        const __m128i h = _mm_loadu_si128((const __m128i *)(p + d));
        const __m256 f = dtype == 1 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
                                    : _mm256_cvtph_ps(h);
        _mm256_storeu_ps(out + d, f);
    }
}

/* unpack_generic in registers: codes decoded (and scaled: code * scale + zero) with one store per vector. */
AVX2 static inline __attribute__((always_inline)) void unpack_avx2_bits(const uint8_t *p, const int bits, int64_t g,
                                                                       int64_t groups, const uint16_t *s,
                                                                       const uint16_t *z, float *out) {
    const int64_t pg = (g * bits + 7) / 8, per_byte = 8 / bits;
    if (pg % 8 || pg * per_byte != g) { unpack_generic(p, bits, g, groups, s, z, out); return; }
    const __m256i mask = _mm256_set1_epi32((1 << bits) - 1);
    for (int64_t j = 0; j < groups; ++j, p += pg, out += g) {
        const __m256 sj = _mm256_set1_ps(s ? _cvtsh_ss(s[j]) : 1.f), zj = _mm256_set1_ps(s ? _cvtsh_ss(z[j]) : 0.f);
        for (int64_t i = 0; i < pg; i += 8) {
            const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + i)));
            for (int64_t k = 0; k < per_byte; ++k) {
                const __m256i c = _mm256_and_si256(_mm256_srl_epi32(b, _mm_cvtsi32_si128((int)(k * bits))), mask);
                const __m256 f = _mm256_cvtepi32_ps(c);
                _mm256_storeu_ps(out + k * pg + i, s ? _mm256_fmadd_ps(f, sj, zj) : f);
            }
        }
    }
}

AVX2 static inline void unpack_avx2(const uint8_t *p, int bits, int64_t g, int64_t groups, const uint16_t *s,
                                    const uint16_t *z, float *out) {
    CONST_BITS(unpack_avx2_bits, p, bits, g, groups, s, z, out)
}

AVX2 static inline void halfs_avx2(const uint16_t *h, int64_t n, float *out) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
    for (; i < n; ++i) out[i] = _cvtsh_ss(h[i]);
}

AVX2 static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

AVX2 static inline void dots_avx2(const float *q, const float *row, int64_t G, int64_t D, float *s) {
    if (D % 8) { dots_generic(q, row, G, D, s); return; }
    __m256 acc[MAX_G];
    for (int64_t h = 0; h < G; ++h) acc[h] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
        const __m256 r = _mm256_loadu_ps(row + d);
        for (int64_t h = 0; h < G; ++h) acc[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * D + d), r, acc[h]);
    }
    for (int64_t h = 0; h < G; ++h) s[h] = hsum(acc[h]);
}

AVX2 static inline void axpys_avx2(const float *p, const float *row, int64_t G, int64_t D, float *acc) {
    if (D % 8) { axpys_generic(p, row, G, D, acc); return; }
    for (int64_t d = 0; d < D; d += 8) {
        const __m256 r = _mm256_loadu_ps(row + d);
        for (int64_t h = 0; h < G; ++h) {
            float *a = acc + h * D + d;
            _mm256_storeu_ps(a, _mm256_fmadd_ps(_mm256_set1_ps(p[h]), r, _mm256_loadu_ps(a)));
        }
    }
}

/* Eight row sums at once: a[t] -> (sum of a[0], ..., sum of a[7]). */
AVX2 static inline __m256 hsum8(const __m256 *a) {
    const __m256 s0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 s1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20), _mm256_permute2f128_ps(s0, s1, 0x31));
}

/* dots_tile for head_dim 64 and a whole tile: each head's query in registers, eight scores per store. */
AVX2 static inline void dots_tile_avx2(const float *q, const float *tile, int64_t nt, int64_t G, int64_t D,
                                       float *out, int64_t stride) {
    if (D != 64 || nt != TILE) {
        float s[MAX_G];
        for (int64_t t = 0; t < nt; ++t) {
            dots_avx2(q, tile + t * D, G, D, s);
            for (int64_t h = 0; h < G; ++h) out[h * stride + t] = s[h];
        }
        return;
    }
    for (int64_t h = 0; h < G; ++h) {
        __m256 qv[8], a[TILE];
        for (int j = 0; j < 8; ++j) qv[j] = _mm256_loadu_ps(q + h * 64 + 8 * j);
        for (int t = 0; t < TILE; ++t) {
            const float *r = tile + t * 64;
            __m256 x = _mm256_mul_ps(qv[0], _mm256_load_ps(r)), y = _mm256_mul_ps(qv[1], _mm256_load_ps(r + 8));
            x = _mm256_fmadd_ps(qv[2], _mm256_load_ps(r + 16), x);
            y = _mm256_fmadd_ps(qv[3], _mm256_load_ps(r + 24), y);
            x = _mm256_fmadd_ps(qv[4], _mm256_load_ps(r + 32), x);
            y = _mm256_fmadd_ps(qv[5], _mm256_load_ps(r + 40), y);
            x = _mm256_fmadd_ps(qv[6], _mm256_load_ps(r + 48), x);
            y = _mm256_fmadd_ps(qv[7], _mm256_load_ps(r + 56), y);
            a[t] = _mm256_add_ps(x, y);
        }
        _mm256_storeu_ps(out + h * stride, hsum8(a));
    }
}

/* axpys_tile for head_dim 64 and a whole tile: each head's accumulator stays in eight registers. */
AVX2 static inline void axpys_tile_avx2(const float *p, int64_t stride, const float *tile, int64_t nt, int64_t G,
                                        int64_t D, float *acc) {
    if (D != 64 || nt != TILE) {
        float s[MAX_G];
        for (int64_t t = 0; t < nt; ++t) {
            for (int64_t h = 0; h < G; ++h) s[h] = p[h * stride + t];
            axpys_avx2(s, tile + t * D, G, D, acc);
        }
        return;
    }
    for (int64_t h = 0; h < G; ++h) {
        __m256 a[8];
        for (int j = 0; j < 8; ++j) a[j] = _mm256_loadu_ps(acc + h * 64 + 8 * j);
        for (int t = 0; t < TILE; ++t) {
            const __m256 w = _mm256_set1_ps(p[h * stride + t]);
            for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(w, _mm256_load_ps(tile + t * 64 + 8 * j), a[j]);
        }
        for (int j = 0; j < 8; ++j) _mm256_storeu_ps(acc + h * 64 + 8 * j, a[j]);
    }
}

/* exp(x) for x <= 0: 2^n * e^r with |r| <= ln2 / 2 and a degree-6 Taylor polynomial (relative error
 * about 1.2e-7); x below -87 gives exactly 0, as expf's underflow would. */
AVX2 static inline __m256 exp_avx2(__m256 x) {
    const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_GE_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.f / 720);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.f / 120));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.f / 24));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.f / 6));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(0.5f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e)), keep);
}

AVX2 static inline float maxs_avx2(const float *x, int64_t n) {
    __m256 m8 = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(x + i));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    float m = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    for (; i < n; ++i) m = x[i] > m ? x[i] : m;
    return m;
}

AVX2 static inline float exps_avx2(float *x, int64_t n, float m) {
    const __m256 mm = _mm256_set1_ps(m);
    __m256 sum = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(x + i), mm));
        _mm256_storeu_ps(x + i, e);
        sum = _mm256_add_ps(sum, e);
    }
    float s = hsum(sum);
    for (; i < n; ++i) { x[i] = expf(x[i] - m); s += x[i]; }
    return s;
}

#endif

#ifdef KVPLAY_X86
/* ------------------------------------------------------------------ AVX-512 primitives
 * Sixteen floats per vector: head_dim 64 is four registers. Shapes the AVX-512 code does not cover (head_dim
 * other than 64, groups that are not whole vectors) fall through to the AVX2 primitives. */
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")))

AVX512 static inline void row16_avx512(const void *src, int64_t r, int dtype, int64_t D, float *out) {
    if (dtype == 0 || D % 16) { row16_avx2(src, r, dtype, D, out); return; }
    const uint16_t *p = (const uint16_t *)src + r * D;
    for (int64_t d = 0; d < D; d += 16) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)(p + d));
        const __m512 f = dtype == 1 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
                                    : _mm512_cvtph_ps(h);
        _mm512_storeu_ps(out + d, f);
    }
}

AVX512 static inline __attribute__((always_inline)) void unpack_avx512_bits(const uint8_t *p, const int bits,
                                                                           int64_t g, int64_t groups,
                                                                           const uint16_t *s, const uint16_t *z,
                                                                           float *out) {
    const int64_t pg = (g * bits + 7) / 8, per_byte = 8 / bits;
    if (pg % 16 || pg * per_byte != g) { unpack_avx2(p, bits, g, groups, s, z, out); return; }
    const __m512i mask = _mm512_set1_epi32((1 << bits) - 1);
    for (int64_t j = 0; j < groups; ++j, p += pg, out += g) {
        const __m512 sj = _mm512_set1_ps(s ? _cvtsh_ss(s[j]) : 1.f), zj = _mm512_set1_ps(s ? _cvtsh_ss(z[j]) : 0.f);
        for (int64_t i = 0; i < pg; i += 16) {
            const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + i)));
            for (int64_t k = 0; k < per_byte; ++k) {
                const __m512i c = _mm512_and_si512(_mm512_srl_epi32(b, _mm_cvtsi32_si128((int)(k * bits))), mask);
                const __m512 f = _mm512_cvtepi32_ps(c);
                _mm512_storeu_ps(out + k * pg + i, s ? _mm512_fmadd_ps(f, sj, zj) : f);
            }
        }
    }
}

AVX512 static inline void unpack_avx512(const uint8_t *p, int bits, int64_t g, int64_t groups, const uint16_t *s,
                                        const uint16_t *z, float *out) {
    CONST_BITS(unpack_avx512_bits, p, bits, g, groups, s, z, out)
}

/* dots_tile for head_dim 64 and a whole tile: each head's query in four registers, eight scores per store. */
AVX512 static inline void dots_tile_avx512(const float *q, const float *tile, int64_t nt, int64_t G, int64_t D,
                                           float *out, int64_t stride) {
    if (D != 64 || nt != TILE) { dots_tile_avx2(q, tile, nt, G, D, out, stride); return; }
    for (int64_t h = 0; h < G; ++h) {
        const __m512 q0 = _mm512_loadu_ps(q + h * 64), q1 = _mm512_loadu_ps(q + h * 64 + 16);
        const __m512 q2 = _mm512_loadu_ps(q + h * 64 + 32), q3 = _mm512_loadu_ps(q + h * 64 + 48);
        __m256 a[TILE];
        for (int t = 0; t < TILE; ++t) {
            const float *r = tile + t * 64;
            __m512 x = _mm512_mul_ps(q0, _mm512_load_ps(r)), y = _mm512_mul_ps(q1, _mm512_load_ps(r + 16));
            x = _mm512_fmadd_ps(q2, _mm512_load_ps(r + 32), x);
            y = _mm512_fmadd_ps(q3, _mm512_load_ps(r + 48), y);
            x = _mm512_add_ps(x, y);
            a[t] = _mm256_add_ps(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps(x, 1));
        }
        _mm256_storeu_ps(out + h * stride, hsum8(a));
    }
}

/* axpys_tile for head_dim 64 and a whole tile: each head's accumulator stays in four registers. */
AVX512 static inline void axpys_tile_avx512(const float *p, int64_t stride, const float *tile, int64_t nt,
                                            int64_t G, int64_t D, float *acc) {
    if (D != 64 || nt != TILE) { axpys_tile_avx2(p, stride, tile, nt, G, D, acc); return; }
    for (int64_t h = 0; h < G; ++h) {
        __m512 a[4];
        for (int j = 0; j < 4; ++j) a[j] = _mm512_loadu_ps(acc + h * 64 + 16 * j);
        for (int t = 0; t < TILE; ++t) {
            const __m512 w = _mm512_set1_ps(p[h * stride + t]);
            for (int j = 0; j < 4; ++j) a[j] = _mm512_fmadd_ps(w, _mm512_load_ps(tile + t * 64 + 16 * j), a[j]);
        }
        for (int j = 0; j < 4; ++j) _mm512_storeu_ps(acc + h * 64 + 16 * j, a[j]);
    }
}

#endif

/* ------------------------------------------------------------------ one chunk of tokens */

typedef struct { int kind; int64_t from, to, pos; } chunk_t;   /* kind 0 sink, 1 quantized (blocks), 2 window */

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

/* Scores, max, exp, sum and value accumulation of one chunk for the G heads of (b, kv head hk), TILE rows
 * at a time (rows decoded to float once, then used by every head). res: G maxima, G sums, then G * D
 * accumulators. sc: scratch of G * (chunk tokens) scores, then probabilities. */
#define CHUNK(NAME, ATTR, ROW16, UNPACK, HALFS, DOTS, DOTS_T, AXPYS_T, MAXS, EXPS)                   \
ATTR static void NAME(const attend_t *A, int64_t b, int64_t hk, const chunk_t *c, float *res, float *sc) { \
    const int64_t G = A->G, D = A->D, bh = b * A->Hkv + hk;                                       \
    float *m = res, *l = res + G, *acc = res + 2 * G;                                             \
    float tile[TILE * MAX_D] __attribute__((aligned(32))), qs[MAX_G * MAX_D] __attribute__((aligned(32))); \
    float bias[MAX_G];                                                                            \
    const float *mask = A->mask ? A->mask + b * A->mask_b + c->pos : NULL;                        \
    const float *q = (c->kind == 1 ? A->q_rot : A->q) + bh * G * D;                               \
    const int quant = c->kind == 1, sink = c->kind == 0, size = A->dtype16 ? 2 : 4;               \
    const int64_t n = quant ? (c->to - c->from) * A->T : c->to - c->from;                         \
    const int64_t first = quant ? c->from * A->T : c->from;       /* row index within its segment */ \
    const int64_t kP = (D * A->kbits + 7) / 8, groups = D / A->vg, vP = groups * ((A->vg * A->vbits + 7) / 8); \
    const uint8_t *kp = quant ? A->kp + b * A->kp_b + hk * A->kp_h : NULL;                        \
    const uint8_t *vp = quant ? A->vp + b * A->vp_b + hk * A->vp_h : NULL;                        \
    const uint16_t *ks = quant ? A->ks + b * A->km_b + hk * A->km_h : NULL;                       \
    const uint16_t *kz = quant ? A->kz + b * A->km_b + hk * A->km_h : NULL;                       \
    const uint16_t *vs = quant ? A->vs + b * A->vm_b + hk * A->vm_h : NULL;                       \
    const uint16_t *vz = quant ? A->vz + b * A->vm_b + hk * A->vm_h : NULL;                       \
    const int64_t off = b * (sink ? A->sink_b : A->win_b) + hk * (sink ? A->sink_h : A->win_h);   \
    const void *K = (const char *)(sink ? A->sink_k : A->win_k) + off * size;                     \
    const void *V = (const char *)(sink ? A->sink_v : A->win_v) + off * size;                     \
    memset(acc, 0, G * D * sizeof(float));                                                        \
    for (int64_t i = 0, nt; i < n; i += nt) {            /* pass 1: scores */                     \
        const int64_t left = quant ? A->T - i % A->T : n - i;     /* tiles never straddle blocks */ \
        nt = left < TILE ? left : TILE;                                                           \
        const int64_t r = first + i;                                                              \
        if (quant && i % A->T == 0) {                    /* a new block: fold its scales and zeros */ \
            const int64_t blk = r / A->T;                                                         \
            HALFS(ks + blk * D, D, tile);                                                         \
            for (int64_t h = 0; h < G; ++h)                                                       \
                for (int64_t d = 0; d < D; ++d) qs[h * D + d] = q[h * D + d] * tile[d];           \
            HALFS(kz + blk * D, D, tile);                                                         \
            DOTS(q, tile, G, D, bias);                                                            \
        }                                                                                         \
        for (int64_t t = 0; t < nt; ++t) {                                                        \
            if (quant) UNPACK(kp + (r + t) * kP, A->kbits, D, 1, NULL, NULL, tile + t * D);       \
            else ROW16(K, r + t, A->dtype16, D, tile + t * D);                                    \
        }                                                                                         \
        DOTS_T(quant ? qs : q, tile, nt, G, D, sc + i, n);                                        \
        for (int64_t h = 0; h < G; ++h) {  /* separate loops: a vectorized "mask ? mask[i] : 0" becomes */ \
            float *x = sc + h * n + i;     /* a masked load from NULL, a microcode assist per tile */     \
            if (quant) for (int64_t t = 0; t < nt; ++t) x[t] += bias[h];                          \
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
            if (quant) UNPACK(vp + (r + t) * vP, A->vbits, A->vg, groups, vs + (r + t) * groups,   \
                            vz + (r + t) * groups, tile + t * D);                                 \
            else ROW16(V, r + t, A->dtype16, D, tile + t * D);                                    \
        }                                                                                         \
        AXPYS_T(sc + i, n, tile, nt, G, D, acc);                                                  \
    }                                                                                             \
}

CHUNK(chunk_generic, , row16_generic, unpack_generic, halfs_generic, dots_generic, dots_tile_generic,
      axpys_tile_generic, maxs_generic, exps_generic)
#ifdef KVPLAY_X86
CHUNK(chunk_avx2, AVX2, row16_avx2, unpack_avx2, halfs_avx2, dots_avx2, dots_tile_avx2, axpys_tile_avx2, maxs_avx2,
      exps_avx2)
CHUNK(chunk_avx512, AVX512, row16_avx512, unpack_avx512, halfs_avx2, dots_avx2, dots_tile_avx512, axpys_tile_avx512,
      maxs_avx2, exps_avx2)
#endif

#ifdef KVPLAY_X86
/* ------------------------------------------------------------------ AVX-512, head_dim 64: quantized chunks in registers
 * The chunk above decodes each row into a float tile in memory, then reads it back once per head. For the
 * common shape (head_dim 64, 2/4/8-bit codes, up to four query heads per KV head) a row's 64 codes are
 * decoded straight into four registers and used there: keys against each head's folded query, values
 * rebuilt and accumulated for each head, with the heads' query and accumulators held in registers.
 *
 * A row of 64 codes at `bits` is 8 * bits bytes, read as 16-byte pieces: register m * per_byte + k holds
 * the k-th code of bytes 16m .. 16m + 15. With planar groups of g codes (pg bytes each), byte B's k-th code
 * is channel (B / pg) * g + k * pg + B % pg, so each register lane has a fixed channel and group. Keys are
 * one group of 64: a register is 16 consecutive channels. Values may mix groups in a register; their
 * accumulators stay in register order and are put back in channel order at the end. */

typedef struct {
    int chan[4][16];        /* register lane -> channel */
    int group[4][16];       /* register lane -> value group */
} lanes_t;

static void lanes(int bits, int64_t g, lanes_t *L) {
    const int per_byte = 8 / bits;
    const int64_t pg = g * bits / 8;
    for (int r = 0; r < 4; ++r)
        for (int l = 0; l < 16; ++l) {
            const int64_t B = 16 * (r / per_byte) + l, k = r % per_byte;
            L->group[r][l] = (int)(B / pg);
            L->chan[r][l] = (int)((B / pg) * g + k * pg + B % pg);
        }
}

/* Whether qchunk64 covers this job: head_dim 64, whole tiles per block, 2/4/8-bit codes, at most 16 value
 * groups per row, each a whole number of bytes. */
static int q64_covers(const attend_t *A) {
    const int kb = A->kbits, vb = A->vbits;
    return A->D == 64 && A->T % TILE == 0 && (kb == 2 || kb == 4 || kb == 8) && (vb == 2 || vb == 4 || vb == 8)
           && A->vg >= 4 && 64 % A->vg == 0 && A->vg * vb % 8 == 0;
}

/* A row of 64 codes -> four registers of float codes (see above). */
AVX512 static inline __attribute__((always_inline)) void codes64(const uint8_t *p, const int bits, __m512 c[4]) {
    const __m512i mask = _mm512_set1_epi32((1 << bits) - 1);
    if (bits == 8) {
        for (int m = 0; m < 4; ++m) c[m] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p + m)));
    } else if (bits == 4) {
        for (int m = 0; m < 2; ++m) {
            const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p + m));
            c[2 * m] = _mm512_cvtepi32_ps(_mm512_and_si512(b, mask));
            c[2 * m + 1] = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
        }
    } else {
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
        c[0] = _mm512_cvtepi32_ps(_mm512_and_si512(b, mask));
        c[1] = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(b, 2), mask));
        c[2] = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(b, 4), mask));
        c[3] = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 6));
    }
}

#define KBITS_SWITCH(bits, CALL) \
    switch (bits) { case 2: CALL(2); break; case 4: CALL(4); break; default: CALL(8); }

/* CHUNK for a quantized chunk, with G (query heads per KV head) a constant. */
AVX512 static inline __attribute__((always_inline)) void qchunk64(const attend_t *A, int64_t b, int64_t hk,
                                                                 const chunk_t *c, float *res, float *sc,
                                                                 const int G) {
    const int64_t T = A->T, bh = b * A->Hkv + hk, n = (c->to - c->from) * T, first = c->from * T;
    const int kbits = A->kbits, vbits = A->vbits, groups = (int)(64 / A->vg);
    const int64_t kP = 8 * kbits, vP = 8 * vbits;
    float *m = res, *l = res + G, *acc_out = res + 2 * G;
    const float *mask = A->mask ? A->mask + b * A->mask_b + c->pos : NULL;
    const float *q = A->q_rot + bh * G * 64;
    const uint8_t *kp = A->kp + b * A->kp_b + hk * A->kp_h, *vp = A->vp + b * A->vp_b + hk * A->vp_h;
    const uint16_t *ks = A->ks + b * A->km_b + hk * A->km_h, *kz = A->kz + b * A->km_b + hk * A->km_h;
    const uint16_t *vs = A->vs + b * A->vm_b + hk * A->vm_h, *vz = A->vz + b * A->vm_b + hk * A->vm_h;
    lanes_t kl, vl;
    lanes(kbits, 64, &kl);
    lanes(vbits, A->vg, &vl);
    int koff[4];                                          /* a key register's first channel */
    for (int r = 0; r < 4; ++r) koff[r] = kl.chan[r][0];
    /* pass 1: scores, a block's scales folded into the query and its zero points into one bias per head */
    for (int64_t i0 = 0; i0 < n; i0 += T) {
        const int64_t blk = (first + i0) / T;
        __m512 qs[4][4], zb[4];
        for (int h = 0; h < G; ++h) zb[h] = _mm512_setzero_ps();
        for (int r = 0; r < 4; ++r) {
            const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(ks + blk * 64 + koff[r])));
            const __m512 z = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(kz + blk * 64 + koff[r])));
            for (int h = 0; h < G; ++h) {
                const __m512 qh = _mm512_loadu_ps(q + h * 64 + koff[r]);
                qs[h][r] = _mm512_mul_ps(qh, s);
                zb[h] = _mm512_fmadd_ps(qh, z, zb[h]);
            }
        }
        float bias[4];
        for (int h = 0; h < G; ++h) bias[h] = _mm512_reduce_add_ps(zb[h]);
        for (int64_t t0 = 0; t0 < T; t0 += TILE) {
            __m256 a[4][TILE];
            for (int t = 0; t < TILE; ++t) {
                __m512 cc[4];
                const uint8_t *row = kp + (first + i0 + t0 + t) * kP;
#define KCODES(B) codes64(row, B, cc)
                KBITS_SWITCH(kbits, KCODES)
#undef KCODES
                for (int h = 0; h < G; ++h) {
                    __m512 x = _mm512_mul_ps(cc[0], qs[h][0]), y = _mm512_mul_ps(cc[1], qs[h][1]);
                    x = _mm512_fmadd_ps(cc[2], qs[h][2], x);
                    y = _mm512_fmadd_ps(cc[3], qs[h][3], y);
                    x = _mm512_add_ps(x, y);
                    a[h][t] = _mm256_add_ps(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps(x, 1));
                }
            }
            for (int h = 0; h < G; ++h) {
                __m256 s = _mm256_add_ps(hsum8(a[h]), _mm256_set1_ps(bias[h]));
                if (mask) s = _mm256_add_ps(s, _mm256_loadu_ps(mask + i0 + t0));
                _mm256_storeu_ps(sc + h * n + i0 + t0, s);
            }
        }
    }
    for (int h = 0; h < G; ++h) {
        m[h] = maxs_avx2(sc + h * n, n);
        l[h] = m[h] == -INFINITY ? 0.f : exps_avx2(sc + h * n, n, m[h]);
        if (m[h] == -INFINITY) memset(sc + h * n, 0, n * sizeof(float));
    }
    /* pass 2: each value row rebuilt once (code * scale + zero, the lane's group), accumulated for every head */
    __m512 acc[4][4];
    for (int h = 0; h < G; ++h)
        for (int r = 0; r < 4; ++r) acc[h][r] = _mm512_setzero_ps();
    __m512i gidx[4];
    for (int r = 0; r < 4; ++r) gidx[r] = _mm512_loadu_si512((const void *)vl.group[r]);
    const __mmask16 gmask = (__mmask16)((1u << groups) - 1u);
    int same = 1;                         /* every register's lanes in the same groups (kvplay-int2's values) */
    for (int r = 1; r < 4; ++r) same &= !memcmp(vl.group[r], vl.group[0], sizeof vl.group[0]);
    for (int64_t i = 0; i < n; ++i) {
        const int64_t r0 = first + i;
        __m512 cc[4], s[4], z[4];
        const uint8_t *row = vp + r0 * vP;
#define VCODES(B) codes64(row, B, cc)
        KBITS_SWITCH(vbits, VCODES)
#undef VCODES
        if (groups == 1) {
            s[0] = s[1] = s[2] = s[3] = _mm512_set1_ps(_cvtsh_ss(vs[r0]));
            z[0] = z[1] = z[2] = z[3] = _mm512_set1_ps(_cvtsh_ss(vz[r0]));
        } else {
            const __m512 sv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(gmask, vs + r0 * groups));
            const __m512 zv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(gmask, vz + r0 * groups));
            for (int r = 0; r < (same ? 1 : 4); ++r) {
                s[r] = _mm512_permutexvar_ps(gidx[r], sv);
                z[r] = _mm512_permutexvar_ps(gidx[r], zv);
            }
            if (same) { s[1] = s[2] = s[3] = s[0]; z[1] = z[2] = z[3] = z[0]; }
        }
        for (int r = 0; r < 4; ++r) cc[r] = _mm512_fmadd_ps(cc[r], s[r], z[r]);
        for (int h = 0; h < G; ++h) {
            const __m512 p = _mm512_set1_ps(sc[h * n + i]);
            for (int r = 0; r < 4; ++r) acc[h][r] = _mm512_fmadd_ps(p, cc[r], acc[h][r]);
        }
    }
    for (int h = 0; h < G; ++h) {
        float lane[64];
        for (int r = 0; r < 4; ++r) _mm512_storeu_ps(lane + 16 * r, acc[h][r]);
        for (int r = 0; r < 4; ++r)
            for (int j = 0; j < 16; ++j) acc_out[h * 64 + vl.chan[r][j]] = lane[16 * r + j];
    }
}

/* chunk_avx512, with quantized chunks of the shapes qchunk64 covers (G <= 4) taken in registers. */
AVX512 static void chunk_avx512_q64(const attend_t *A, int64_t b, int64_t hk, const chunk_t *c, float *res,
                                    float *sc) {
    if (c->kind == 1 && q64_covers(A)) switch (A->G) {
        case 1: qchunk64(A, b, hk, c, res, sc, 1); return;
        case 2: qchunk64(A, b, hk, c, res, sc, 2); return;
        case 3: qchunk64(A, b, hk, c, res, sc, 3); return;
        case 4: qchunk64(A, b, hk, c, res, sc, 4); return;
    }
    chunk_avx512(A, b, hk, c, res, sc);
}
#endif

/* ------------------------------------------------------------------ entry point */

/* Returns 0, or -1 if a shape is out of range or scratch memory could not be allocated (nothing written). */
/* scaling * query, as float32 (B, Hkv * G, D), and that @ R for the quantized part (the same if no rotation). */
static void queries(const attend_t *A, float *q, float *q_rot) {
    const int64_t H = A->Hkv * A->G, D = A->D;
    for (int64_t b = 0; b < A->B; ++b)
        for (int64_t h = 0; h < H; ++h)
            for (int64_t d = 0; d < D; ++d)
                q[(b * H + h) * D + d] = load_float(A->query, A->query_dtype, b * A->query_b + h * A->query_h + d)
                                         * A->scaling;
    if (!A->rot) return;
    for (int64_t r = 0; r < A->B * H; ++r)
        for (int64_t e = 0; e < D; ++e) {
            float a = 0.f;
            for (int64_t d = 0; d < D; ++d) a += q[r * D + d] * A->rot[d * D + e];       /* (q @ R)[e] */
            q_rot[r * D + e] = a;
        }
}

int kvplay_attend(const attend_t *job) {
    attend_t J = *job;
    const attend_t *A = &J;
    if (A->G < 1 || A->G > MAX_G || A->D < 1 || A->D > MAX_D || A->T < 1 || A->chunk < 1) return -1;
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
            for (int64_t k = 0; k < per; ++k) {
                const float mk = res[(x * per + k) * width + h];
                M = mk > M ? mk : M;
            }
            for (int64_t k = 0; k < per; ++k) {
                const float *r = res + (x * per + k) * width;
                if (r[h] == -INFINITY) continue;
                const float w = expf(r[h] - M);
                float *into = chunks[k].kind == 1 && A->rot ? rotated : plain;
                L += w * r[G + h];
                for (int64_t d = 0; d < D; ++d) into[d] += w * r[2 * G + h * D + d];
            }
            if (A->rot)
                for (int64_t e = 0; e < D; ++e) {
                    float a = 0.f;
                    for (int64_t d = 0; d < D; ++d) a += rotated[d] * A->rot[e * D + d];   /* (acc @ R^T)[e] */
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
