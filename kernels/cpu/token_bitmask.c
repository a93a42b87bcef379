/* Grammar token bitmasks applied to float32 logits on CPUs (see kernels/cpu/token_bitmask.py).
 *
 * A bitmask row holds one bit per token, 32 tokens to an int32 word, bit j of word w
 * standing for token 32 * w + j; a 0 bit means the token is not allowed, and its logit
 * becomes -inf. Grammars allow few tokens at most positions (JSON: a handful of the
 * vocabulary), so most words are 0 and are stored as two vectors of -inf; all-ones words
 * are skipped; the rest are expanded to lane masks. Rows are independent; large calls
 * are split over OpenMP threads.
 */
#include <math.h>
#include <stdint.h>

#include "vec.h"

#define PARALLEL_MIN_ELEMS 65536 /* below this, one thread: the fork/join costs more */

/* logits[rows[i], t] = -inf for every t < vocab_size whose bit in bitmask row rows[i] is 0.
 * Rows are `logits_stride` floats and `bitmask_stride` words apart. Returns 0, or -1 when
 * a row index is negative. */
int apply_token_bitmask_f32(float *logits, int64_t logits_stride, const int32_t *bitmask, int64_t bitmask_stride,
                            const int64_t *rows, int32_t num_rows, int32_t vocab_size, int32_t num_threads) {
    for (int32_t i = 0; i < num_rows; i++)
        if (rows[i] < 0) return -1;
    const int32_t full_words = vocab_size / 32;
    const v16 neg_inf = splat(-INFINITY);
    const v16i lo = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const v16i hi = lo + 16;
#pragma omp parallel for num_threads(num_threads) if ((int64_t)num_rows * vocab_size >= PARALLEL_MIN_ELEMS) \
    schedule(static)
    for (int32_t i = 0; i < num_rows; i++) {
        float *row = logits + rows[i] * logits_stride;
        const int32_t *mask = bitmask + rows[i] * bitmask_stride;
        for (int32_t w = 0; w < full_words; w++) {
            const int32_t word = mask[w];
            if (word == -1) continue;
            float *out = row + 32 * (int64_t)w;
            if (word == 0) {
                STORE(out, neg_inf);
                STORE(out + VEC, neg_inf);
                continue;
            }
            const v16i bits = (v16i){0} + word;
            /* A lane whose bit is 1 keeps its logit: (bits >> lane) & 1 is 1 there, -1 after negation. */
            STORE(out, select_v16(-((bits >> lo) & 1), LOAD(out), neg_inf));
            STORE(out + VEC, select_v16(-((bits >> hi) & 1), LOAD(out + VEC), neg_inf));
        }
        for (int32_t t = 32 * full_words; t < vocab_size; t++)
            if (!((mask[t / 32] >> (t % 32)) & 1)) row[t] = -INFINITY;
    }
    return 0;
}
