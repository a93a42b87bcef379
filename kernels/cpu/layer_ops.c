/* Fused element-wise layer operations for CPUs, float32 (see kernels/cpu/layer_ops.py).
 *
 * Each replaces a chain of torch element-wise ops that would each read and write
 * the whole activation: residual add + RMSNorm, rotary embedding in place, and
 * SiLU(gate) * up. Rows are independent; large calls are split over OpenMP threads.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec.h"

#define PARALLEL_MIN_ELEMS 65536 /* below this, one thread: the fork/join costs more */

/* out = rmsnorm(x (+ residual)) * weight, rows of `hidden` floats. With a residual,
 * residual <- x + residual first (the pre-norm sum the next layer adds to). */
void add_rms_norm_f32(const float *x, float *residual, const float *weight, float *out, int64_t rows,
                      int32_t hidden, float eps, int32_t num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * hidden >= PARALLEL_MIN_ELEMS) schedule(static)
    for (int64_t t = 0; t < rows; t++) {
        const float *xt = x + t * hidden;
        float *rt = residual ? residual + t * hidden : NULL;
        float *ot = out + t * hidden;
        float sum = 0.0f;
        if (rt) {
#pragma omp simd reduction(+ : sum)
            for (int i = 0; i < hidden; i++) {
                float v = xt[i] + rt[i];
                rt[i] = v;
                sum += v * v;
            }
            xt = rt;
        } else {
#pragma omp simd reduction(+ : sum)
            for (int i = 0; i < hidden; i++) sum += xt[i] * xt[i];
        }
        float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
        for (int i = 0; i < hidden; i++) ot[i] = weight[i] * (xt[i] * inv);
    }
}

/* Rotary embedding in place, half-split layout: for each row t and head h,
 * (x1, x2) <- (x1*cos - x2*sin, x2*cos + x1*sin) with cos/sin the rows of the
 * [max_positions, head_dim/2] tables at positions[t]. Rows are `row_stride` floats
 * apart, so q and k can be rotated inside the fused qkv projection output. */
void rotary_f32(float *x, int64_t rows, int64_t row_stride, int32_t heads, int32_t head_dim,
                const int64_t *positions, const float *cos_table, const float *sin_table, int32_t num_threads) {
    const int half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) if (rows * heads * head_dim >= PARALLEL_MIN_ELEMS) schedule(static)
    for (int64_t t = 0; t < rows; t++) {
        const float *c = cos_table + positions[t] * half;
        const float *s = sin_table + positions[t] * half;
        for (int h = 0; h < heads; h++) {
            float *x1 = x + t * row_stride + (int64_t)h * head_dim, *x2 = x1 + half;
            for (int i = 0; i < half; i++) {
                float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
    }
}

/* out[t, i] = silu(gate_up[t, i]) * gate_up[t, inter + i]  (the SwiGLU of Llama's MLP). */
void silu_and_mul_f32(const float *gate_up, float *out, int64_t rows, int32_t inter, int32_t num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * inter >= PARALLEL_MIN_ELEMS) schedule(static)
    for (int64_t t = 0; t < rows; t++) {
        const float *g = gate_up + t * 2 * (int64_t)inter, *u = g + inter;
        float *o = out + t * inter;
        int i = 0;
        for (; i + VEC <= inter; i += VEC) STORE(o + i, silu_mul_v16(LOAD(g + i), LOAD(u + i)));
        if (i < inter) { /* tail: through a padded vector, so it rounds exactly like the body */
            v16 x = {0}, y = {0};
            for (int j = 0; i + j < inter; j++) x[j] = g[i + j], y[j] = u[i + j];
            v16 z = silu_mul_v16(x, y);
            for (int j = 0; i + j < inter; j++) o[i + j] = z[j];
        }
    }
}
