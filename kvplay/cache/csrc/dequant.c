/* kvplay's CPU dequantization kernel: planar-packed 2/4/8-bit codes -> codes * scale + zero.
 *
 * One pass over the packed bytes, writing bfloat16 or float32 straight into the caller's
 * buffer, rows split across OpenMP threads, with an AVX2 path picked at run time on x86-64.
 * The eager PyTorch path (quant.dequantize_int) makes about six passes with float32
 * intermediates; this kernel computes exactly the same numbers: a float32 multiply, then a
 * float32 add (built with -ffp-contract=off, so nothing fuses them), then round-to-nearest-even.
 *
 * Layout, with a = batch * head and r = token row (rows contiguous within a):
 *   packed  uint8  [a * p_a + (r * G + j) * pg + i]    group j of row r, planar: byte i holds
 *                                                      codes i, i + pg, i + 2 pg, ... (low bits first)
 *   scale   float  row pointer scale + a * s_a + (r / rdiv) * s_r, then [j * g + c] when per_code
 *   zero    float  (one scale per channel: keys), else [j] (one per group: values)
 *   out     bf16 or float  [a * o_a + (r * G + j) * g + c]
 * Values are assumed finite (the cache refuses NaN/inf before quantizing).
 */
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KVPLAY_X86 1
#endif

typedef struct {
    const uint8_t *packed; int64_t p_a;
    const float *scale, *zero; int64_t s_a, s_r, rdiv; int per_code;
    void *out; int64_t o_a; int out_f32;
    int64_t A, R, G, g, pg; int bits;
} job_t;

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u);   /* round to nearest, ties to even */
    return (uint16_t)(u >> 16);
}

/* Codes [from, stop) of plane k of one group, scalar. */
static inline void plane_scalar(const job_t *J, const uint8_t *p, const float *s, const float *z,
                                void *o, int64_t start, int64_t from, int64_t stop, int shift) {
    const unsigned mask = (1u << J->bits) - 1u;
    for (int64_t i = from; i < stop; ++i) {
        const int64_t c = start + i;
        const float sc = J->per_code ? s[c] : s[0], zc = J->per_code ? z[c] : z[0];
        float v = (float)((p[i] >> shift) & mask) * sc;
        v = v + zc;
        if (J->out_f32) ((float *)o)[c] = v; else ((uint16_t *)o)[c] = to_bf16(v);
    }
}

#ifdef KVPLAY_X86
/* Eight codes at a time: zero-extend bytes to 32 bits, shift, mask, convert, scale, round, store. */
__attribute__((target("avx2")))
static int64_t plane_avx2(const job_t *J, const uint8_t *p, const float *s, const float *z,
                          void *o, int64_t start, int64_t stop, int shift) {
    const __m256i mask = _mm256_set1_epi32((1 << J->bits) - 1);
    const __m128i count = _mm_cvtsi32_si128(shift);
    const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7FFF);
    __m256 vs = _mm256_set1_ps(s[0]), vz = _mm256_set1_ps(z[0]);
    int64_t i = 0;
    for (; i + 8 <= stop; i += 8) {
        const int64_t c = start + i;
        __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + i)));
        q = _mm256_and_si256(_mm256_srl_epi32(q, count), mask);
        if (J->per_code) { vs = _mm256_loadu_ps(s + c); vz = _mm256_loadu_ps(z + c); }
        __m256 v = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q), vs), vz);
        if (J->out_f32) { _mm256_storeu_ps((float *)o + c, v); continue; }
        __m256i u = _mm256_castps_si256(v);
        u = _mm256_add_epi32(u, _mm256_add_epi32(bias, _mm256_and_si256(_mm256_srli_epi32(u, 16), one)));
        u = _mm256_srli_epi32(u, 16);
        u = _mm256_permute4x64_epi64(_mm256_packus_epi32(u, u), 0x08);   /* lanes 0-3, 4-7 -> low half */
        _mm_storeu_si128((__m128i *)((uint16_t *)o + c), _mm256_castsi256_si128(u));
    }
    return i;
}

static int have_avx2(void) {
    static int cached = -1;
    if (cached < 0) cached = __builtin_cpu_supports("avx2") ? 1 : 0;
    return cached;
}
#endif

static void run(const job_t *J) {
    const int64_t per_byte = 8 / J->bits, width = J->G * J->g, size = J->out_f32 ? 4 : 2;
#ifdef KVPLAY_X86
    const int avx2 = have_avx2();
#endif
    #pragma omp parallel for collapse(2) schedule(static) if (J->A * J->R * width >= 65536)
    for (int64_t a = 0; a < J->A; ++a) {
        for (int64_t r = 0; r < J->R; ++r) {
            const int64_t srow = a * J->s_a + (r / J->rdiv) * J->s_r;
            for (int64_t j = 0; j < J->G; ++j) {
                const uint8_t *p = J->packed + a * J->p_a + (r * J->G + j) * J->pg;
                const float *s = J->scale + srow + (J->per_code ? j * J->g : j);
                const float *z = J->zero + srow + (J->per_code ? j * J->g : j);
                void *o = (char *)J->out + (a * J->o_a + r * width + j * J->g) * size;
                for (int64_t k = 0; k < per_byte; ++k) {
                    const int64_t start = k * J->pg;
                    const int64_t stop = (J->g - start) < J->pg ? (J->g - start) : J->pg;
                    int64_t done = 0;
#ifdef KVPLAY_X86
                    if (avx2) done = plane_avx2(J, p, s, z, o, start, stop, (int)(k * J->bits));
#endif
                    plane_scalar(J, p, s, z, o, start, done, stop, (int)(k * J->bits));
                }
            }
        }
    }
}

void kvplay_dequant(const uint8_t *packed, int64_t p_a, const float *scale, const float *zero, int64_t s_a,
                    int64_t s_r, int64_t rdiv, int per_code, void *out, int64_t o_a, int out_f32, int64_t A,
                    int64_t R, int64_t G, int64_t g, int64_t pg, int bits) {
    const job_t J = {packed, p_a, scale, zero, s_a, s_r, rdiv, per_code, out, o_a, out_f32, A, R, G, g, pg, bits};
    run(&J);
}

/* 1 if this build took OpenMP, for the tests and the benchmark's machine record. */
int kvplay_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}
