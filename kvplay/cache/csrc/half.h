/* float16 helpers shared by kvplay's kernels (dequant.c, attend.c): one definition, so both read scales alike. */
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

#endif
