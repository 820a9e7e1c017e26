/* attend.c's AVX-512 code (F, BW, DQ, VL): its primitives, sixteen floats per vector, the chunk loop built from
 * them (chunk_avx512), and the head_dim-64 path that keeps a quantized chunk in registers (chunk_avx512_q64,
 * what kvplay_attend runs). Part of attend.c, which includes it after attend_avx2.h (the shapes this code does
 * not cover fall through to AVX2 primitives); not compiled on its own. */
#ifndef KVPLAY_ATTEND_AVX512_H
#define KVPLAY_ATTEND_AVX512_H

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

/* ggml_row_generic with sixteen floats per vector for q8_0 and q4_0 (a block is one 16-byte load, both nibbles);
 * the other types take the portable row. */
AVX512 static inline void ggml_row_avx512(const uint8_t *p, int type, int64_t D, const uint16_t *d, const uint16_t *m,
                                    const uint8_t *qh, float *out) {
    if (type != GGML_Q8_0 && type != GGML_Q4_0) { ggml_row_generic(p, type, D, d, m, qh, out); return; }
    const __m512i nib = _mm512_set1_epi32(15), eight = _mm512_set1_epi32(8);
    for (int64_t j = 0; j < D / QK; ++j, out += QK) {
        const __m512 s = _mm512_set1_ps(d ? _cvtsh_ss(d[j]) : 1.f);
        if (type == GGML_Q8_0) {
            for (int i = 0; i < QK; i += 16) {
                const __m512i c = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + j * QK + i)));
                _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_cvtepi32_ps(c), s));
            }
        } else {
            const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + j * QK / 2)));
            const __m512i lo = _mm512_sub_epi32(_mm512_and_si512(b, nib), eight);
            _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_cvtepi32_ps(lo), s));
            _mm512_storeu_ps(out + QK / 2,
                             _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(b, 4), eight)), s));
        }
    }
}

GGML_SCORES_VIA_ROWS(ggml_scores_avx512, AVX512, ggml_row_avx512, dots_tile_avx512)

CHUNK(chunk_avx512, AVX512, row16_avx512, unpack_avx512, halfs_avx2, dots_avx2, dots_tile_avx512, axpys_tile_avx512,
      maxs_avx2, exps_avx2, ggml_row_avx512, ggml_scores_avx512)

/* ------------------------------------------------------------------ AVX-512, head_dim 64: quantized chunks in registers
 * The chunk above decodes each row into a float tile in memory, then reads it back once per head. For the
 * common shape (head_dim 64, 2/3/4/8-bit codes, up to four query heads per KV head) a row's 64 codes are
 * decoded straight into four registers and used there: keys against each head's folded query, values
 * rebuilt and accumulated for each head, with the heads' query and accumulators held in registers.
 *
 * A row of 64 codes at `bits` is 8 * bits bytes, read as 16-byte pieces: register m * per_byte + k holds
 * the k-th code of bytes 16m .. 16m + 15. With planar groups of g codes (pg bytes each), byte B's k-th code
 * is channel (B / pg) * g + k * pg + B % pg, so each register lane has a fixed channel and group. Keys are
 * one group of 64: a register is 16 consecutive channels. Values may mix groups in a register; their
 * accumulators stay in register order and are put back in channel order at the end. 3-bit codes are a bit
 * stream in channel order (8 codes in 3 bytes): register m is channels 16m .. 16m + 15, from bytes 6m .. 6m + 5. */

typedef struct {
    int chan[4][16];        /* register lane -> channel */
    int group[4][16];       /* register lane -> value group */
} lanes_t;

static void lanes(int bits, int64_t g, lanes_t *L) {
    if (bits == 3) {                    /* a bit stream in channel order: register r holds channels 16r .. 16r + 15 */
        for (int r = 0; r < 4; ++r)
            for (int l = 0; l < 16; ++l) {
                L->chan[r][l] = 16 * r + l;
                L->group[r][l] = (int)((16 * r + l) / g);
            }
        return;
    }
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
    return A->D == 64 && A->T % TILE == 0 && !A->kggml && !A->vggml && (kb == 2 || kb == 3 || kb == 4 || kb == 8)
           && (vb == 2 || vb == 3 || vb == 4 || vb == 8)
           && A->vg >= 4 && 64 % A->vg == 0 && A->vg * vb % 8 == 0 && (vb != 3 || A->vg % 8 == 0);
}

/* A row of 64 codes -> four registers of float codes (see above). */
AVX512 static inline __attribute__((always_inline)) void codes64(const uint8_t *p, const int bits, __m512 c[4]) {
    const __m512i mask = _mm512_set1_epi32((1 << bits) - 1);
    if (bits == 3) {                    /* register m: bytes 6m .. 6m + 5, two 24-bit words of 8 codes each */
        const __m512i shifts = _mm512_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21, 0, 3, 6, 9, 12, 15, 18, 21);
        for (int m = 0; m < 4; ++m) {
            const uint8_t *b = p + 6 * m;
            const int w0 = b[0] | b[1] << 8 | b[2] << 16, w1 = b[3] | b[4] << 8 | b[5] << 16;
            const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(w0)),
                                                 _mm256_set1_epi32(w1), 1);
            c[m] = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(w, shifts), mask));
        }
    } else if (bits == 8) {
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
    switch (bits) { case 2: CALL(2); break; case 3: CALL(3); break; case 4: CALL(4); break; default: CALL(8); }

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
    const int k8 = A->kmeta8, v8 = A->vmeta8;                 /* 8-bit metadata: byte arrays, same strides */
    const uint8_t *ks8 = (const uint8_t *)A->ks + b * A->km_b + hk * A->km_h;
    const int8_t *kz8 = (const int8_t *)A->kz + b * A->km_b + hk * A->km_h;
    const uint8_t *vs8 = (const uint8_t *)A->vs + b * A->vm_b + hk * A->vm_h;
    const int8_t *vz8 = (const int8_t *)A->vz + b * A->vm_b + hk * A->vm_h;
    float ksf[64], kzf[64], vsf[16], vzf[16];
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
        if (k8) {
            meta8_scales(ks8 + blk * 64, 64, A->meta8, ksf);
            meta8_zeros(ks8 + blk * 64, kz8 + blk * 64, 64, A->meta8, kzf);
        }
        for (int r = 0; r < 4; ++r) {
            const __m512 s = k8 ? _mm512_loadu_ps(ksf + koff[r])
                                : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(ks + blk * 64 + koff[r])));
            const __m512 z = k8 ? _mm512_loadu_ps(kzf + koff[r])
                                : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(kz + blk * 64 + koff[r])));
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
        if (v8 && groups == 1) {          /* the row's groups decoded to float: the product, then the sum */
            vsf[0] = A->meta8[vs8[r0]];
            vzf[0] = (float)vz8[r0] * vsf[0] / META8_ZERO_UNITS;
        } else if (v8) {
            meta8_scales(vs8 + r0 * groups, groups, A->meta8, vsf);
            meta8_zeros(vs8 + r0 * groups, vz8 + r0 * groups, groups, A->meta8, vzf);
        }
        if (groups == 1) {
            s[0] = s[1] = s[2] = s[3] = _mm512_set1_ps(v8 ? vsf[0] : _cvtsh_ss(vs[r0]));
            z[0] = z[1] = z[2] = z[3] = _mm512_set1_ps(v8 ? vzf[0] : _cvtsh_ss(vz[r0]));
        } else {
            const __m512 sv = v8 ? _mm512_maskz_loadu_ps(gmask, vsf)
                                 : _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(gmask, vs + r0 * groups));
            const __m512 zv = v8 ? _mm512_maskz_loadu_ps(gmask, vzf)
                                 : _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(gmask, vz + r0 * groups));
            for (int r = 0; r < (same ? 1 : 4); ++r) {
                s[r] = _mm512_permutexvar_ps(gidx[r], sv);
                z[r] = _mm512_permutexvar_ps(gidx[r], zv);
            }
            if (same) { s[1] = s[2] = s[3] = s[0]; z[1] = z[2] = z[3] = z[0]; }
        }
        if (v8) for (int r = 0; r < 4; ++r) cc[r] = _mm512_add_ps(_mm512_mul_ps(cc[r], s[r]), z[r]);
        else for (int r = 0; r < 4; ++r) cc[r] = _mm512_fmadd_ps(cc[r], s[r], z[r]);
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

/* ------------------------------------------------------------------ AVX-512, head_dim 64: ggml rows in registers
 * A row of 64 ggml codes is two blocks of 32: four registers in channel order (q8_0: 16 bytes each; q4_0: a
 * block's 16 bytes give its low nibbles, elements 0-15, and its high ones, 16-31), q4_0's offset taken off
 * in integers. A key's score is d_0 * (q_0 . codes_0) + d_1 * (q_1 . codes_1); a value row is rebuilt as
 * d_b * code and accumulated for every head, whose accumulators stay in registers. Rows are not blocks here
 * (T = 1), so the last tile of a chunk may be short: its scores are stored under a mask. */

/* A row of 64 ggml codes of this type -> four registers of float codes, offset removed. */
AVX512 static inline __attribute__((always_inline)) void ggml_codes64(const uint8_t *p, const int type, __m512 c[4]) {
    if (type == GGML_Q8_0) {
        for (int m = 0; m < 4; ++m)
            c[m] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p + m)));
        return;
    }
    const __m512i nib = _mm512_set1_epi32(15), eight = _mm512_set1_epi32(8);
    for (int m = 0; m < 2; ++m) {
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p + m));
        c[2 * m] = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(b, nib), eight));
        c[2 * m + 1] = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(b, 4), eight));
    }
}

#define GGML_SWITCH(type, CALL) \
    switch (type) { case GGML_Q8_0: CALL(GGML_Q8_0); break; default: CALL(GGML_Q4_0); }

/* CHUNK for a quantized chunk of ggml rows (head_dim 64), with G (query heads per KV head) a constant. */
AVX512 static inline __attribute__((always_inline)) void qchunk64_ggml(const attend_t *A, int64_t b, int64_t hk,
                                                                      const chunk_t *c, float *res, float *sc,
                                                                      const int G) {
    const int64_t bh = b * A->Hkv + hk, n = (c->to - c->from) * A->T, first = c->from * A->T;
    const int64_t kP = A->kggml == GGML_Q8_0 ? 64 : 32, vP = A->vggml == GGML_Q8_0 ? 64 : 32;
    float *m = res, *l = res + G, *acc_out = res + 2 * G;
    const float *mask = A->mask ? A->mask + b * A->mask_b + c->pos : NULL;
    const float *q = A->q_rot + bh * G * 64;
    const uint8_t *kp = A->kp + b * A->kp_b + hk * A->kp_h, *vp = A->vp + b * A->vp_b + hk * A->vp_h;
    const uint16_t *kd = A->ks + b * A->km_b + hk * A->km_h, *vd = A->vs + b * A->vm_b + hk * A->vm_h;
    __m512 qv[4][4];
    for (int h = 0; h < G; ++h)
        for (int r = 0; r < 4; ++r) qv[h][r] = _mm512_loadu_ps(q + h * 64 + 16 * r);
    /* pass 1: scores */
    for (int64_t t0 = 0; t0 < n; t0 += TILE) {
        const int nt = n - t0 < TILE ? (int)(n - t0) : TILE;
        __m256 a[4][TILE];
        for (int t = 0; t < TILE; ++t) {
            if (t >= nt) {
                for (int h = 0; h < G; ++h) a[h][t] = _mm256_setzero_ps();
                continue;
            }
            const int64_t row = first + t0 + t;
            __m512 cc[4];
#define KCODES(TYPE) ggml_codes64(kp + row * kP, TYPE, cc)
            GGML_SWITCH(A->kggml, KCODES)
#undef KCODES
            const __m512 d0 = _mm512_set1_ps(_cvtsh_ss(kd[2 * row])), d1 = _mm512_set1_ps(_cvtsh_ss(kd[2 * row + 1]));
            for (int h = 0; h < G; ++h) {
                __m512 x = _mm512_mul_ps(cc[0], qv[h][0]), y = _mm512_mul_ps(cc[2], qv[h][2]);
                x = _mm512_fmadd_ps(cc[1], qv[h][1], x);
                y = _mm512_fmadd_ps(cc[3], qv[h][3], y);
                x = _mm512_fmadd_ps(x, d0, _mm512_mul_ps(y, d1));        /* d_0 (q_0 . c_0) + d_1 (q_1 . c_1) */
                a[h][t] = _mm256_add_ps(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps(x, 1));
            }
        }
        const __mmask8 keep = (__mmask8)((1u << nt) - 1u);
        for (int h = 0; h < G; ++h) {
            __m256 s = hsum8(a[h]);
            if (mask) s = _mm256_add_ps(s, _mm256_maskz_loadu_ps(keep, mask + t0));
            _mm256_mask_storeu_ps(sc + h * n + t0, keep, s);
        }
    }
    for (int h = 0; h < G; ++h) {
        m[h] = maxs_avx2(sc + h * n, n);
        l[h] = m[h] == -INFINITY ? 0.f : exps_avx2(sc + h * n, n, m[h]);
        if (m[h] == -INFINITY) memset(sc + h * n, 0, n * sizeof(float));
    }
    /* pass 2: each value row rebuilt once (d_b * code), accumulated for every head */
    __m512 acc[4][4];
    for (int h = 0; h < G; ++h)
        for (int r = 0; r < 4; ++r) acc[h][r] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; ++i) {
        const int64_t row = first + i;
        __m512 cc[4];
#define VCODES(TYPE) ggml_codes64(vp + row * vP, TYPE, cc)
        GGML_SWITCH(A->vggml, VCODES)
#undef VCODES
        const __m512 d0 = _mm512_set1_ps(_cvtsh_ss(vd[2 * row])), d1 = _mm512_set1_ps(_cvtsh_ss(vd[2 * row + 1]));
        cc[0] = _mm512_mul_ps(cc[0], d0);
        cc[1] = _mm512_mul_ps(cc[1], d0);
        cc[2] = _mm512_mul_ps(cc[2], d1);
        cc[3] = _mm512_mul_ps(cc[3], d1);
        for (int h = 0; h < G; ++h) {
            const __m512 p = _mm512_set1_ps(sc[h * n + i]);
            for (int r = 0; r < 4; ++r) acc[h][r] = _mm512_fmadd_ps(p, cc[r], acc[h][r]);
        }
    }
    for (int h = 0; h < G; ++h)
        for (int r = 0; r < 4; ++r) _mm512_storeu_ps(acc_out + h * 64 + 16 * r, acc[h][r]);
}

/* chunk_avx512, with quantized chunks of the shapes qchunk64 and qchunk64_ggml cover (G <= 4) in registers. */
AVX512 static void chunk_avx512_q64(const attend_t *A, int64_t b, int64_t hk, const chunk_t *c, float *res,
                                    float *sc) {
    const int kreg = A->kggml == GGML_Q8_0 || A->kggml == GGML_Q4_0;
    const int vreg = A->vggml == GGML_Q8_0 || A->vggml == GGML_Q4_0;
    if (c->kind == 1 && A->D == 64 && kreg && vreg) switch (A->G) {
        case 1: qchunk64_ggml(A, b, hk, c, res, sc, 1); return;
        case 2: qchunk64_ggml(A, b, hk, c, res, sc, 2); return;
        case 3: qchunk64_ggml(A, b, hk, c, res, sc, 3); return;
        case 4: qchunk64_ggml(A, b, hk, c, res, sc, 4); return;
    }
    if (c->kind == 1 && q64_covers(A)) switch (A->G) {
        case 1: qchunk64(A, b, hk, c, res, sc, 1); return;
        case 2: qchunk64(A, b, hk, c, res, sc, 2); return;
        case 3: qchunk64(A, b, hk, c, res, sc, 3); return;
        case 4: qchunk64(A, b, hk, c, res, sc, 4); return;
    }
    chunk_avx512(A, b, hk, c, res, sc);
}

#endif
