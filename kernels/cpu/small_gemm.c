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

/* y [m, n] = x [m, k] W^T (+ bias [n]), W [n, k], all contiguous float32, 1 <= m <= 8. The weight
 * rows are split over the threads in tasks of 16, each thread's tasks contiguous (static
 * schedule), so each streams its part of W once. Returns 0, or -1 for m outside [1, 8]. */
int small_gemm_f32(const float *x, int64_t m, const float *w, int64_t n, int64_t k, const float *bias, float *y,
                   int32_t num_threads) {
    if (m < 1 || m > MAX_ROWS) return -1;
    const tile_fn wide = WIDE[m], one = ONE[m];
    const int width = WIDTH[m];
    const int64_t tasks = (n + TASK_ROWS - 1) / TASK_ROWS;
#pragma omp parallel for num_threads(num_threads) if (tasks > 1) schedule(static)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t n1 = (t + 1) * TASK_ROWS < n ? (t + 1) * TASK_ROWS : n;
        int64_t j = t * TASK_ROWS;
        for (; j + width <= n1; j += width) wide(x, w + j * k, k, y + j, n, bias ? bias + j : 0);
        for (; j < n1; j++) one(x, w + j * k, k, y + j, n, bias ? bias + j : 0);
    }
    return 0;
}
