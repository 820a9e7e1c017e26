/* attend.c's AVX2 code (with FMA and F16C): its primitives, eight floats per vector, and the chunk loop built
 * from them (chunk_avx2). Part of attend.c, which includes it after its portable primitives and CHUNK; not
 * compiled on its own. */
#ifndef KVPLAY_ATTEND_AVX2_H
#define KVPLAY_ATTEND_AVX2_H
#include <immintrin.h>

/* ------------------------------------------------------------------ AVX2 primitives */
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
    if (bits == 3 && g % 8 == 0) {      /* a bit stream: 8 codes from each 3 bytes, one variable shift */
        const __m256i shifts = _mm256_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21), seven = _mm256_set1_epi32(7);
        for (int64_t j = 0; j < groups; ++j, out += g) {
            const __m256 sj = _mm256_set1_ps(s ? _cvtsh_ss(s[j]) : 1.f), zj = _mm256_set1_ps(s ? _cvtsh_ss(z[j]) : 0.f);
            for (int64_t c = 0; c < g; c += 8) {
                const uint8_t *b = p + j * pg + c / 8 * 3;
                const __m256i w = _mm256_set1_epi32(b[0] | b[1] << 8 | b[2] << 16);
                const __m256 f = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(w, shifts), seven));
                _mm256_storeu_ps(out + c, s ? _mm256_fmadd_ps(f, sj, zj) : f);
            }
        }
        return;
    }
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

/* ggml_row_generic with eight floats per vector for q8_0 and q4_0 (the same exact products: d * (code - offset));
 * the other types take the portable row. */
AVX2 static inline void ggml_row_avx2(const uint8_t *p, int type, int64_t D, const uint16_t *d, const uint16_t *m,
                                    const uint8_t *qh, float *out) {
    if (type != GGML_Q8_0 && type != GGML_Q4_0) { ggml_row_generic(p, type, D, d, m, qh, out); return; }
    const __m256i nib = _mm256_set1_epi32(15), eight = _mm256_set1_epi32(8);
    for (int64_t j = 0; j < D / QK; ++j, out += QK) {
        const __m256 s = _mm256_set1_ps(d ? _cvtsh_ss(d[j]) : 1.f);
        if (type == GGML_Q8_0) {
            for (int i = 0; i < QK; i += 8) {
                const __m256i c = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + j * QK + i)));
                _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_cvtepi32_ps(c), s));
            }
        } else {
            for (int i = 0; i < QK / 2; i += 8) {
                const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + j * QK / 2 + i)));
                const __m256i lo = _mm256_sub_epi32(_mm256_and_si256(b, nib), eight);
                const __m256i hi = _mm256_sub_epi32(_mm256_srli_epi32(b, 4), eight);
                _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_cvtepi32_ps(lo), s));
                _mm256_storeu_ps(out + QK / 2 + i, _mm256_mul_ps(_mm256_cvtepi32_ps(hi), s));
            }
        }
    }
}

GGML_SCORES_VIA_ROWS(ggml_scores_avx2, AVX2, ggml_row_avx2, dots_tile_avx2)

CHUNK(chunk_avx2, AVX2, row16_avx2, unpack_avx2, halfs_avx2, dots_avx2, dots_tile_avx2, axpys_tile_avx2, maxs_avx2,
      exps_avx2, ggml_row_avx2, ggml_scores_avx2)

#endif
