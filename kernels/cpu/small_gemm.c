/* y = x W^T (+ bias) for a few rows of x: a decode step's linear layers (see kernels/cpu/linear.py).
 *
 * At decode batches a linear is a stream of its weight from memory with little arithmetic per
 * byte; MKL's GEMM (packed or not) reaches its bandwidth only at one or two rows. Here each task
 * streams 16 weight rows once (W as the model stores it, [n, k], no second copy) against up to
 * eight rows of x held in L1, with the accumulators over k in registers and one reduction per
 * output at the end, and prefetches the weight 8 KB ahead: the hardware prefetcher alone does not
 * keep enough lines in flight while the FMAs of eight rows run (docs/benchmarks/layers.md). */
#include <stdint.h>

#include "vec.h"

#define MAX_ROWS 8
#define TASK_ROWS 16     /* weight rows a task streams */
#define PREFETCH_AHEAD 2048 /* floats: 8 KB ahead of the load, within a thread's contiguous rows */

/* ROWS rows of x against NW consecutive weight rows (NW * ROWS accumulators). */
#define DEFINE_TILE(ROWS, NW)                                                                             \
    static inline void tile_##ROWS##_##NW(const float *x, const float *w, int64_t k, float *y, int64_t ldy, \
                                          const float *bias) {                                           \
        v16 acc[ROWS][NW];                                                                                \
        for (int r = 0; r < ROWS; r++)                                                                    \
            for (int j = 0; j < NW; j++) acc[r][j] = (v16){0};                                            \
        int64_t kk = 0;                                                                                   \
        for (; kk + VEC <= k; kk += VEC) {                                                                \
            v16 wv[NW];                                                                                   \
            for (int j = 0; j < NW; j++) {                                                                \
                __builtin_prefetch(w + j * k + kk + PREFETCH_AHEAD);                                      \
                wv[j] = LOAD(w + j * k + kk);                                                             \
            }                                                                                             \
            for (int r = 0; r < ROWS; r++) {                                                              \
                v16 xv = LOAD(x + r * k + kk);                                                            \
                for (int j = 0; j < NW; j++) acc[r][j] += xv * wv[j];                                     \
            }                                                                                             \
        }                                                                                                 \
        for (int r = 0; r < ROWS; r++)                                                                    \
            for (int j = 0; j < NW; j++) {                                                                \
                float s = hsum(acc[r][j]);                                                                \
                for (int64_t t = kk; t < k; t++) s += x[r * k + t] * w[j * k + t];                        \
                y[r * ldy + j] = bias ? s + bias[j] : s;                                                  \
            }                                                                                             \
    }

/* Wide tiles: few rows take four weight rows at once, so that enough FMAs are independent. */
DEFINE_TILE(1, 4)
DEFINE_TILE(2, 4)
DEFINE_TILE(3, 4)
DEFINE_TILE(4, 2)
DEFINE_TILE(5, 2)
DEFINE_TILE(6, 2)
DEFINE_TILE(7, 2)
DEFINE_TILE(8, 2)
/* One weight row: a task's rows left over from the wide tiles. */
DEFINE_TILE(1, 1)
DEFINE_TILE(2, 1)
DEFINE_TILE(3, 1)
DEFINE_TILE(4, 1)
DEFINE_TILE(5, 1)
DEFINE_TILE(6, 1)
DEFINE_TILE(7, 1)
DEFINE_TILE(8, 1)

typedef void (*tile_fn)(const float *, const float *, int64_t, float *, int64_t, const float *);
static const tile_fn WIDE[MAX_ROWS + 1] = {0,        tile_1_4, tile_2_4, tile_3_4, tile_4_2,
                                           tile_5_2, tile_6_2, tile_7_2, tile_8_2};
static const int WIDTH[MAX_ROWS + 1] = {0, 4, 4, 4, 2, 2, 2, 2, 2};
static const tile_fn ONE[MAX_ROWS + 1] = {0,        tile_1_1, tile_2_1, tile_3_1, tile_4_1,
                                          tile_5_1, tile_6_1, tile_7_1, tile_8_1};

/* y[r * ldy + j] = x[r] . w[j] (+ bias[j]) for the `rows` weight rows from w (bias from the same row). */
static inline void stream_rows(const float *x, int64_t m, const float *w, int64_t k, int64_t rows, float *y,
                               int64_t ldy, const float *bias) {
    const tile_fn wide = WIDE[m], one = ONE[m];
    const int width = WIDTH[m];
    int64_t j = 0;
    for (; j + width <= rows; j += width) wide(x, w + j * k, k, y + j, ldy, bias ? bias + j : 0);
    for (; j < rows; j++) one(x, w + j * k, k, y + j, ldy, bias ? bias + j : 0);
}

/* y [m, n] = x [m, k] W^T (+ bias [n]), W [n, k], all contiguous float32, 1 <= m <= 8. The weight
 * rows are split over the threads in tasks of 16, each thread's tasks contiguous (static
 * schedule), so each streams its part of W once. Returns 0, or -1 for m outside [1, 8]. */
int small_gemm_f32(const float *x, int64_t m, const float *w, int64_t n, int64_t k, const float *bias, float *y,
                   int32_t num_threads) {
    if (m < 1 || m > MAX_ROWS) return -1;
    const int64_t tasks = (n + TASK_ROWS - 1) / TASK_ROWS;
#pragma omp parallel for num_threads(num_threads) if (tasks > 1) schedule(static)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t j0 = t * TASK_ROWS, j1 = j0 + TASK_ROWS < n ? j0 + TASK_ROWS : n;
        stream_rows(x, m, w + j0 * k, k, j1 - j0, y + j0, n, bias ? bias + j0 : 0);
    }
    return 0;
}

/* The MLP's gate and up projections with its SwiGLU, for 1 <= m <= 8 rows: out [m, inter] =
 * silu(x Wg^T + bg) * (x Wu^T + bu), W = [Wg; Wu] [2 inter, k] as the model fuses them, bias
 * [2 inter] or NULL. A task takes 16 gate rows and the 16 matching up rows into a tile of its
 * own and applies silu-and-multiply there (silu_mul_v16, as layer_ops.c does), so the [m, 2 inter]
 * projection is never written out and read back by another thread. The same sums as
 * small_gemm_f32: the result equals it followed by silu_and_mul_f32, bit for bit. */
int small_gemm_silu_mul_f32(const float *x, int64_t m, const float *w, int64_t inter, int64_t k, const float *bias,
                            float *out, int32_t num_threads) {
    if (m < 1 || m > MAX_ROWS) return -1;
    const int64_t tasks = (inter + TASK_ROWS - 1) / TASK_ROWS;
#pragma omp parallel for num_threads(num_threads) if (tasks > 1) schedule(static)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t j0 = t * TASK_ROWS, cols = j0 + TASK_ROWS < inter ? TASK_ROWS : inter - j0;
        float gate[MAX_ROWS * TASK_ROWS] __attribute__((aligned(64)));
        float up[MAX_ROWS * TASK_ROWS] __attribute__((aligned(64)));
        stream_rows(x, m, w + j0 * k, k, cols, gate, TASK_ROWS, bias ? bias + j0 : 0);
        stream_rows(x, m, w + (inter + j0) * k, k, cols, up, TASK_ROWS, bias ? bias + inter + j0 : 0);
        for (int64_t r = 0; r < m; r++) {
            v16 g = {0}, u = {0};
            for (int64_t j = 0; j < cols; j++) g[j] = gate[r * TASK_ROWS + j], u[j] = up[r * TASK_ROWS + j];
            const v16 z = silu_mul_v16(g, u);
            for (int64_t j = 0; j < cols; j++) out[r * inter + j0 + j] = z[j];
        }
    }
    return 0;
}
