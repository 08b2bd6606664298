/* bfloat16 <-> float for the C kernels (c_library puts this folder on their include path). */
#ifndef PAGED_BF16_H
#define PAGED_BF16_H
#include <stdint.h>

static inline float bf16_to_float(uint16_t x) {
    union { uint32_t u; float f; } bits = { .u = (uint32_t)x << 16 };
    return bits.f;
}

static inline uint16_t bf16_from_float(float f) {  /* round to nearest even, as torch */
    union { float f; uint32_t u; } bits = { .f = f };
    if ((bits.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits.u >> 16) | 0x40);  /* NaN */
    return (uint16_t)((bits.u + 0x7fffu + ((bits.u >> 16) & 1u)) >> 16);
}
#endif
