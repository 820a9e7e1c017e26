/* kvplay's CPU dequantization kernel: planar-packed 2/4/8-bit codes -> codes * scale + zero.
 *
 * One pass over the packed bytes, writing bfloat16 or float32 straight into the caller's
 * buffer, blocks of rows split across OpenMP threads, with AVX2 code picked at run time on
 * x86-64 (fp8 rows too). The eager PyTorch path (quant.dequantize_int) makes about six passes with float32
 * intermediates; this kernel computes exactly the same numbers: a float32 multiply, then a
 * float32 add (built with -ffp-contract=off, so nothing fuses them), then round-to-nearest-even.
 *
 * Layout, with a = batch * head and r = token row (rows contiguous within a):
 *   packed  uint8  [a * p_a + (r * G + j) * pg + i]    group j of row r, planar: byte i holds
 *                                                      codes i, i + pg, i + 2 pg, ... (low bits first)
 *   scale   fp16   row pointer scale + a * s_a + (r / rdiv) * s_r, then [j * g + c] when per_code
 *   zero    fp16   (one scale per channel: keys), else [j] (one per group: values)
 *   out     bf16 or float  [a * o_a + (r * G + j) * g + c]
 * NaN and inf can arrive (the cache refuses NaN/inf keys and values, but a finite bfloat16 value beyond
 * float16's range overflows a scale or zero to inf) and come out as half.h's float_to_bf16 makes them, in the
 * vector code too.
 *
 * Threads: every entry point takes the thread count to use (the caller passes torch's,
 * torch.get_num_threads()), since this library's OpenMP runtime is not the one torch ships.
 * Built without OpenMP, the loops run on the calling thread.
 */
#include <stdint.h>
#include <string.h>

#include "half.h"

/* Placed right before a two-deep loop nest; reads the locals `threads` and `work` (elements written):
 * small jobs stay on the calling thread. */
#ifdef _OPENMP
#include <omp.h>
#define PARALLEL_FOR _Pragma("omp parallel for collapse(2) schedule(static) num_threads(threads) if (work >= 65536)")
#else
#define PARALLEL_FOR (void)threads; (void)work;
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KVPLAY_X86 1
#endif

typedef struct {
    const uint8_t *packed; int64_t p_a;
    const uint16_t *scale, *zero; int64_t s_a, s_r, rdiv; int per_code;   /* float16 bits */
    void *out; int64_t o_a; int out_f32;
    int64_t A, R, G, g, pg; int bits;
    int threads;
} job_t;

/* Codes [from, stop) of one plane (codes start + i), one at a time. */
static inline void plane_scalar(const uint8_t *p, const uint16_t *s, const uint16_t *z, void *o, int64_t start,
                                int64_t from, int64_t stop, int shift, unsigned mask, int per_code, int f32) {
    for (int64_t i = from; i < stop; ++i) {
        const int64_t c = start + i;
        float v = (float)((p[i] >> shift) & mask) * half_to_float(per_code ? s[c] : s[0]);
        v = v + half_to_float(per_code ? z[c] : z[0]);
        if (f32) ((float *)o)[c] = v; else ((uint16_t *)o)[c] = float_to_bf16(v);
    }
}

/* The loops over rows, groups and planes; PLANE handles a prefix of each plane and returns its
 * length, the scalar loop finishes it. Blocks of rows that share a scale row go to one thread. */
#define RUN(NAME, ATTR, PLANE, PER_CODE, F32)                                                      \
ATTR static void NAME(const job_t *J) {                                                            \
    const int64_t per_byte = 8 / J->bits, width = J->G * J->g, pg = J->pg, g = J->g, G = J->G;    \
    const int64_t rdiv = J->rdiv, blocks = J->R / J->rdiv, size = F32 ? 4 : 2;                    \
    const unsigned mask = (1u << J->bits) - 1u;                                                    \
    const int threads = J->threads;                                                                \
    const int64_t work = J->A * J->R * width;                                                      \
    PARALLEL_FOR                                                                                   \
    for (int64_t a = 0; a < J->A; ++a) {                                                           \
        for (int64_t b = 0; b < blocks; ++b) {                                                     \
            const uint16_t *srow = J->scale + a * J->s_a + b * J->s_r;                             \
            const uint16_t *zrow = J->zero + a * J->s_a + b * J->s_r;                              \
            for (int64_t r = b * rdiv; r < (b + 1) * rdiv; ++r) {                                  \
                for (int64_t j = 0; j < G; ++j) {                                                  \
                    const uint8_t *p = J->packed + a * J->p_a + (r * G + j) * pg;                  \
                    const uint16_t *s = srow + (PER_CODE ? j * g : j), *z = zrow + (PER_CODE ? j * g : j); \
                    void *o = (char *)J->out + (a * J->o_a + r * width + j * g) * size;            \
                    for (int64_t k = 0; k < per_byte; ++k) {                                       \
                        const int64_t start = k * pg, stop = (g - start) < pg ? (g - start) : pg;   \
                        const int shift = (int)(k * J->bits);                                      \
                        const int64_t done = PLANE(p, s, z, o, start, stop, shift, mask);          \
                        plane_scalar(p, s, z, o, start, done, stop, shift, mask, PER_CODE, F32);   \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
}

#define NO_VECTOR(p, s, z, o, start, stop, shift, mask) 0
RUN(run_generic_code_bf16, , NO_VECTOR, 1, 0)
RUN(run_generic_code_f32, , NO_VECTOR, 1, 1)
RUN(run_generic_group_bf16, , NO_VECTOR, 0, 0)
RUN(run_generic_group_f32, , NO_VECTOR, 0, 1)

/* fp8 (e4m3fn) with one float16 scale per row: out = lut[byte] * scale. lut holds the 256 e4m3fn
 * values as float (the caller builds it with PyTorch, so the decoding is PyTorch's own). One row: */
static inline __attribute__((always_inline)) void fp8_row(const uint8_t *p, float s, const float *lut, void *o,
                                                          int out_f32, int64_t D) {
    if (out_f32) for (int64_t i = 0; i < D; ++i) ((float *)o)[i] = lut[p[i]] * s;
    else for (int64_t i = 0; i < D; ++i) ((uint16_t *)o)[i] = float_to_bf16(lut[p[i]] * s);
}

/* All rows; built as plain C and again for AVX2, where the compiler vectorizes fp8_row eight floats wide.
 * Baseline x86-64 is four wide, and there float_to_bf16's NaN guard made bfloat16 rows 1.75x slower; the
 * AVX2 build is back to within a few percent of the unguarded four-wide loop (measured 2026-12-02). */
#define RUN_FP8(NAME, ATTR)                                                                        \
ATTR static void NAME(const uint8_t *data, int64_t d_a, const uint16_t *scale, int64_t s_a, const float *lut, \
                      void *out, int64_t o_a, int out_f32, int64_t A, int64_t R, int64_t D, int threads) { \
    const int64_t work = A * R * D, size = out_f32 ? 4 : 2;                                        \
    PARALLEL_FOR                                                                                   \
    for (int64_t a = 0; a < A; ++a)                                                                \
        for (int64_t r = 0; r < R; ++r)                                                            \
            fp8_row(data + a * d_a + r * D, half_to_float(scale[a * s_a + r]), lut,                \
                    (char *)out + (a * o_a + r * D) * size, out_f32, D);                           \
}
RUN_FP8(run_generic_fp8, )

#ifdef KVPLAY_X86
#define AVX2 __attribute__((target("avx2,f16c")))

#define HALF8(ptr) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(ptr)))   /* 8 float16 -> float */

/* float -> bfloat16 bits on eight floats, each result in the low half of its 32-bit lane: the rounding of
 * half.h's float_to_bf16, right for every lane that is not NaN. */
AVX2 static inline __m256i bf16_round(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
}

/* half.h's float_to_bf16 on eight floats: bf16_round, and NaN lanes their sign and top bits, quiet. */
AVX2 static inline __m256i bf16_bits(__m256 v) {
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(_mm256_castps_si256(v), 16), _mm256_set1_epi32(0x40));
    return _mm256_blendv_epi8(bf16_round(v), quiet, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

/* float_to_bf16 on sixteen floats (v0, then v1), packed in order: one compare finds whether any is NaN, and
 * only then do the lanes take bf16_bits' guard (bf16_bits on every step made the kernel about 1.2x slower;
 * this, about 1.05x, measured 2026-12-02). */
AVX2 static inline __m256i bf16_16(__m256 v0, __m256 v1) {
    const int nan = _mm256_movemask_ps(_mm256_cmp_ps(v0, v1, _CMP_UNORD_Q));
    const __m256i both = nan ? _mm256_packus_epi32(bf16_bits(v0), bf16_bits(v1))
                             : _mm256_packus_epi32(bf16_round(v0), bf16_round(v1));
    return _mm256_permute4x64_epi64(both, 0xD8);
}

/* Sixteen codes per step (then eight): zero-extend bytes to 32 bits, shift, mask, convert, scale, then store
 * float32, or round to bfloat16 and pack the sixteen into one 32-byte store. */
#define PLANE_AVX2(NAME, PER_CODE, F32)                                                            \
AVX2 static inline int64_t NAME(const uint8_t *p, const uint16_t *s, const uint16_t *z, void *o,  \
                                int64_t start, int64_t stop, int shift, unsigned bits_mask) {      \
    const __m256i mask = _mm256_set1_epi32((int)bits_mask);                                        \
    const __m128i count = _mm_cvtsi32_si128(shift);                                                \
    const __m256 s0 = _mm256_set1_ps(half_to_float(s[0])), z0 = _mm256_set1_ps(half_to_float(z[0])); \
    int64_t i = 0;                                                                                 \
    for (; i + 16 <= stop; i += 16) {                                                              \
        const int64_t c = start + i;                                                               \
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(p + i));                           \
        __m256i q0 = _mm256_cvtepu8_epi32(bytes), q1 = _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8)); \
        q0 = _mm256_and_si256(_mm256_srl_epi32(q0, count), mask);                                  \
        q1 = _mm256_and_si256(_mm256_srl_epi32(q1, count), mask);                                  \
        const __m256 sa = PER_CODE ? HALF8(s + c) : s0;                                  \
        const __m256 sb = PER_CODE ? HALF8(s + c + 8) : s0;                              \
        const __m256 za = PER_CODE ? HALF8(z + c) : z0;                                  \
        const __m256 zb = PER_CODE ? HALF8(z + c + 8) : z0;                              \
        const __m256 v0 = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q0), sa), za);            \
        const __m256 v1 = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q1), sb), zb);            \
        if (F32) {                                                                                 \
            _mm256_storeu_ps((float *)o + c, v0);                                                  \
            _mm256_storeu_ps((float *)o + c + 8, v1);                                              \
        } else {                                                                                   \
            _mm256_storeu_si256((__m256i *)((uint16_t *)o + c), bf16_16(v0, v1));                \
        }                                                                                          \
    }                                                                                              \
    if (i + 8 <= stop) {                                                                           \
        const int64_t c = start + i;                                                               \
        __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + i)));               \
        q = _mm256_and_si256(_mm256_srl_epi32(q, count), mask);                                    \
        const __m256 v = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q),                        \
                                                     PER_CODE ? HALF8(s + c) : s0),      \
                                       PER_CODE ? HALF8(z + c) : z0);                    \
        if (F32) {                                                                                 \
            _mm256_storeu_ps((float *)o + c, v);                                                   \
        } else {                                                                                   \
            const __m256i u = bf16_bits(v);                                                        \
            _mm_storeu_si128((__m128i *)((uint16_t *)o + c),                                       \
                             _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(u, u), 0x08))); \
        }                                                                                          \
        i += 8;                                                                                    \
    }                                                                                              \
    return i;                                                                                      \
}
PLANE_AVX2(plane_code_bf16, 1, 0)
PLANE_AVX2(plane_code_f32, 1, 1)
PLANE_AVX2(plane_group_bf16, 0, 0)
PLANE_AVX2(plane_group_f32, 0, 1)
/* Values (one scale per group) at 2 or 4 bits, bfloat16 out: a group has only 4 or 16 possible
 * outputs, so compute those once (exactly as above) and look them up sixteen at a time with
 * pshufb, one table for the low bytes of the bfloat16 results and one for the high bytes. */
AVX2 static void group_lut_bf16(const uint8_t *p, uint16_t s_bits, uint16_t z_bits, uint16_t *o, int64_t g,
                                int64_t pg, int bits) {
    const __m256 s = _mm256_set1_ps(half_to_float(s_bits)), z = _mm256_set1_ps(half_to_float(z_bits));
    const __m256 codes = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i t0 = bf16_bits(_mm256_add_ps(_mm256_mul_ps(codes, s), z));
    const __m256i t1 = bf16_bits(_mm256_add_ps(_mm256_mul_ps(_mm256_add_ps(codes, _mm256_set1_ps(8)), s), z));
    uint16_t table[16];
    _mm256_storeu_si256((__m256i *)table, _mm256_permute4x64_epi64(_mm256_packus_epi32(t0, t1), 0xD8));
    const __m128i even = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    const __m128i a = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)table), even);        /* lo 0-7, hi 0-7 */
    const __m128i b = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(table + 8)), even);  /* lo 8-15, hi 8-15 */
    const __m128i lo = _mm_unpacklo_epi64(a, b), hi = _mm_unpackhi_epi64(a, b);
    const __m128i mask = _mm_set1_epi8((char)((1 << bits) - 1));
    for (int64_t k = 0; k < 8 / bits; ++k) {
        const int64_t start = k * pg, stop = (g - start) < pg ? (g - start) : pg;
        const __m128i count = _mm_cvtsi32_si128((int)(k * bits));
        uint16_t *out = o + start;
        int64_t i = 0;
        for (; i + 16 <= stop; i += 16) {
            const __m128i c = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)(p + i)), count), mask);
            const __m128i l = _mm_shuffle_epi8(lo, c), h = _mm_shuffle_epi8(hi, c);
            _mm_storeu_si128((__m128i *)(out + i), _mm_unpacklo_epi8(l, h));
            _mm_storeu_si128((__m128i *)(out + i + 8), _mm_unpackhi_epi8(l, h));
        }
        for (; i + 8 <= stop; i += 8) {
            const __m128i c = _mm_and_si128(_mm_srl_epi16(_mm_loadl_epi64((const __m128i *)(p + i)), count), mask);
            _mm_storeu_si128((__m128i *)(out + i), _mm_unpacklo_epi8(_mm_shuffle_epi8(lo, c), _mm_shuffle_epi8(hi, c)));
        }
        for (; i < stop; ++i) out[i] = table[(p[i] >> (k * bits)) & ((1 << bits) - 1)];
    }
}

AVX2 static void run_avx2_group_bf16_lut(const job_t *J) {
    const int64_t width = J->G * J->g;
    const int threads = J->threads;
    const int64_t work = J->A * J->R * width;
    PARALLEL_FOR
    for (int64_t a = 0; a < J->A; ++a) {
        for (int64_t r = 0; r < J->R; ++r) {
            const int64_t m = a * J->s_a + r * J->s_r;          /* rdiv == 1: a scale per row and group */
            for (int64_t j = 0; j < J->G; ++j)
                group_lut_bf16(J->packed + a * J->p_a + (r * J->G + j) * J->pg, J->scale[m + j], J->zero[m + j],
                               (uint16_t *)J->out + a * J->o_a + r * width + j * J->g, J->g, J->pg, J->bits);
        }
    }
}

RUN(run_avx2_code_bf16, AVX2, plane_code_bf16, 1, 0)
RUN(run_avx2_code_f32, AVX2, plane_code_f32, 1, 1)
RUN(run_avx2_group_bf16, AVX2, plane_group_bf16, 0, 0)
RUN(run_avx2_group_f32, AVX2, plane_group_f32, 0, 1)
RUN_FP8(run_avx2_fp8, AVX2)
#endif

void kvplay_dequant(const uint8_t *packed, int64_t p_a, const uint16_t *scale, const uint16_t *zero, int64_t s_a,
                    int64_t s_r, int64_t rdiv, int per_code, void *out, int64_t o_a, int out_f32, int64_t A,
                    int64_t R, int64_t G, int64_t g, int64_t pg, int bits, int threads) {
    const job_t J = {packed, p_a, scale, zero, s_a, s_r, rdiv, per_code, out, o_a, out_f32, A, R, G, g, pg, bits,
                     threads > 0 ? threads : 1};
    const int variant = 2 * !per_code + !!out_f32;   /* code_bf16, code_f32, group_bf16, group_f32 */
#ifdef KVPLAY_X86
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) {
        if (variant == 2 && bits != 8 && rdiv == 1) {
            run_avx2_group_bf16_lut(&J);
            return;
        }
        void (*const avx2[4])(const job_t *) = {run_avx2_code_bf16, run_avx2_code_f32, run_avx2_group_bf16,
                                                run_avx2_group_f32};
        avx2[variant](&J);
        return;
    }
#endif
    void (*const generic[4])(const job_t *) = {run_generic_code_bf16, run_generic_code_f32, run_generic_group_bf16,
                                               run_generic_group_f32};
    generic[variant](&J);
}

/* fp8 rows (fp8_row above): AVX2 where the CPU has it. */
void kvplay_dequant_fp8(const uint8_t *data, int64_t d_a, const uint16_t *scale, int64_t s_a, const float *lut,
                        void *out, int64_t o_a, int out_f32, int64_t A, int64_t R, int64_t D, int threads) {
    threads = threads > 0 ? threads : 1;
#ifdef KVPLAY_X86
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) {
        run_avx2_fp8(data, d_a, scale, s_a, lut, out, o_a, out_f32, A, R, D, threads);
        return;
    }
#endif
    run_generic_fp8(data, d_a, scale, s_a, lut, out, o_a, out_f32, A, R, D, threads);
}

/* How many threads a parallel loop here runs when asked for n: n with OpenMP, 1 without (tests read it). */
int kvplay_threads(int n) {
    int used = 1;
    n = n > 0 ? n : 1;
#ifdef _OPENMP
    #pragma omp parallel num_threads(n)
    {
        #pragma omp single
        used = omp_get_num_threads();
    }
#endif
    return used;
}
