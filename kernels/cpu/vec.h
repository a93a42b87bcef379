/* Portable 16-float vectors (GCC/Clang vector extensions) and the math the kernels
 * need on them. One v16 is a 512-bit register with AVX-512, two 256-bit ones with
 * AVX2, four with NEON: the compiler splits it for the target (-march=native). */
#ifndef PREFIXSERVE_VEC_H
#define PREFIXSERVE_VEC_H

#include <stdint.h>

#define VEC 16
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4))); /* for unaligned loads and stores */
#define LOAD(p) ((v16) * (const v16u *)(p))
#define STORE(p, x) (*(v16u *)(p) = (x))

static inline v16 splat(float x) { return (v16){0} + x; }

/* Lane-wise a where mask is set, else b (mask lanes are 0 or -1). */
static inline v16 select_v16(v16i mask, v16 a, v16 b) { return (v16)((mask & (v16i)a) | (~mask & (v16i)b)); }

/* Lane permutation of x by constant indices (GCC and Clang spell it differently). */
#if defined(__clang__)
#define PERMUTE(x, ...) __builtin_shufflevector((x), (x), __VA_ARGS__)
#else
#define PERMUTE(x, ...) __builtin_shuffle((x), (v16i){__VA_ARGS__})
#endif
#define SWAP8(x) PERMUTE(x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7)
#define SWAP4(x) PERMUTE(x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11)
#define SWAP2(x) PERMUTE(x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13)
#define SWAP1(x) PERMUTE(x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14)

/* Horizontal max and sum as trees of lane shuffles: 4 dependent steps, not 15. */
static inline float hmax(v16 x) {
    v16 y;
    y = SWAP8(x), x = select_v16(x > y, x, y);
    y = SWAP4(x), x = select_v16(x > y, x, y);
    y = SWAP2(x), x = select_v16(x > y, x, y);
    y = SWAP1(x), x = select_v16(x > y, x, y);
    return x[0];
}

static inline float hsum(v16 x) {
    x += SWAP8(x);
    x += SWAP4(x);
    x += SWAP2(x);
    x += SWAP1(x);
    return x[0];
}

/* exp(x), clamped to [-87, 88] (Cephes expf polynomial, ~1 ulp). libm's expf does
 * not vectorize without -ffast-math, which would also break the kernels' masking. */
static inline v16 exp_v16(v16 x) {
    x = select_v16(x < splat(-87.0f), splat(-87.0f), x);
    x = select_v16(x > splat(88.0f), splat(88.0f), x);
    v16 t = x * 1.44269504088896341f;
    v16 n = (t + 12582912.0f) - 12582912.0f; /* round to nearest: the 1.5 * 2^23 trick */
    v16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
    v16 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    v16i bits = (__builtin_convertvector(n, v16i) + 127) << 23; /* 2^n */
    return p * (v16)bits;
}

/* SiLU(g) * u lane-wise: the SwiGLU of Llama's MLP (layer_ops.c, small_gemm.c). */
static inline v16 silu_mul_v16(v16 g, v16 u) { return g / (1.0f + exp_v16(-g)) * u; }

#endif
