/* 16-bit float helpers shared by kvplay's kernels (dequant.c, attend.c): one definition of each conversion, so
 * both kernels read scales and round results alike. */
#ifndef KVPLAY_HALF_H
#define KVPLAY_HALF_H
#include <stdint.h>
#include <string.h>

/* float16 bits -> float, exactly (scales can be subnormal). */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    uint32_t u;
    if (exp == 0) {                                 /* zero or subnormal: man * 2**-24, exact in float */
        const float f = (float)man * 5.9604644775390625e-08f;
        memcpy(&u, &f, sizeof u);
        u |= sign;
    } else if (exp == 31) {
        u = sign | 0x7F800000u | (man << 13);
    } else {
        u = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* bfloat16 bits -> float, exactly (bfloat16 is float's top half). */
static inline float bf16_to_float(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* float -> bfloat16 bits, rounded to nearest, ties to even, as torch's .to(torch.bfloat16); infinities stay
 * infinite. A NaN stays a NaN: its sign and top mantissa bits, with the quiet bit set (as x86's vcvtneps2bf16
 * does). Without that guard the rounding carry turns a NaN whose payload fills the dropped low bits (float16
 * NaN 0x7FFF as a float: 0x7FFFE000) into -0.0, or +0.0 for 0xFFFF. torch's own NaN bits differ by code path
 * (0x7FC0 from its scalar code, 0xFFFF from its AVX2/AVX-512 code), so a NaN matches torch's only as a NaN.
 * dequant.c's bf16_bits is this on eight floats at once. */
static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#endif
