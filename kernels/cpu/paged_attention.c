/* Paged attention and cache write for CPUs, float32, over a CPU-friendly KV layout.
 *
 * Built at first use by kernels/cpu_attention.py (cc -O3 -march=native -fopenmp) and
 * called through ctypes: one call per layer per step runs every sequence of the step.
 *
 * Layouts (see kernels/cpu_attention.py):
 *   query        [T, H, D]               packed tokens of all sequences; rows (tokens)
 *                                        may be further apart (q_stride floats)
 *   key cache    [NB, KVH, D, BS]        a block's keys stored transposed: for a fixed
 *                                        d the block's BS keys are contiguous, so a
 *                                        score row q.K for 16 keys is 64 vector FMAs
 *                                        with no transpose or horizontal sum
 *   value cache  [NB, KVH, BS, D]        a token's value row is contiguous
 *   block_tables [S, max_blocks] int32, seq_lens [S] int32, query_start_loc [S+1] int32
 * The new tokens of sequence s are its last q_len positions (as in the torch reference).
 *
 * Work is split into tasks (sequence, KV head, tile of query positions); a task reads
 * the sequence's blocks in place (no gather), and keeps the G query heads of its KV
 * head together so each K/V row loaded serves all of them (GQA). Softmax is online
 * (flash-attention style), in float32.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"

#define CHUNK VEC         /* keys scored together: one v16 */
#define MAX_TILE_ROWS 48  /* query rows (positions x heads of a group) per task */
#define MAX_HEAD_DIM 512
#define MASKED (-1e30f)

typedef struct {
    int32_t seq, kv_head, q_begin, q_end; /* query positions [q_begin, q_end) of the sequence's new tokens */
    int32_t first_block;                  /* sort key: sequences sharing a prefix share it */
} Task;

typedef struct {
    float q[MAX_TILE_ROWS * MAX_HEAD_DIM];
    float acc[MAX_TILE_ROWS * MAX_HEAD_DIM];
    v16 scores[MAX_TILE_ROWS];
    float k_stage[MAX_HEAD_DIM * CHUNK]; /* blocks smaller than a chunk, restaged */
    float v_stage[CHUNK * MAX_HEAD_DIM];
    float row_max[MAX_TILE_ROWS];
    v16 row_sum[MAX_TILE_ROWS]; /* lane-wise partial sums, reduced once at the end */
} Scratch;

/* Scores of `rows` query rows against the 16 keys whose dimension d is the 16 floats
 * at k + d * k_stride. Four rows share each loaded key vector; a lone row splits its
 * sum over four accumulators. Both keep four FMA chains in flight. */
static void score_chunk(const float *restrict q, int rows, int head_dim, const float *restrict k, int k_stride,
                        v16 *restrict scores) {
    int r = 0;
    for (; r + 4 <= rows; r += 4) {
        v16 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
        const float *q0 = q + r * head_dim, *q1 = q0 + head_dim, *q2 = q1 + head_dim, *q3 = q2 + head_dim;
        for (int d = 0; d < head_dim; d++) {
            v16 kd = LOAD(k + (int64_t)d * k_stride);
            s0 += q0[d] * kd;
            s1 += q1[d] * kd;
            s2 += q2[d] * kd;
            s3 += q3[d] * kd;
        }
        scores[r] = s0, scores[r + 1] = s1, scores[r + 2] = s2, scores[r + 3] = s3;
    }
    /* One to three rows left: they share each key load, and each row splits its
     * sum over even and odd dimensions so that two to six FMA chains run at once. */
    const int rem = rows - r;
    if (rem > 0) {
        v16 even[3] = {{0}, {0}, {0}}, odd[3] = {{0}, {0}, {0}};
        const float *q0 = q + r * head_dim;
        int d = 0;
        for (; d + 2 <= head_dim; d += 2) {
            v16 k0 = LOAD(k + (int64_t)d * k_stride), k1 = LOAD(k + (int64_t)(d + 1) * k_stride);
            for (int i = 0; i < 3; i++) {
                if (i < rem) {
                    even[i] += q0[i * head_dim + d] * k0;
                    odd[i] += q0[i * head_dim + d + 1] * k1;
                }
            }
        }
        if (d < head_dim) {
            v16 k0 = LOAD(k + (int64_t)d * k_stride);
            for (int i = 0; i < rem; i++) even[i] += q0[i * head_dim + d] * k0;
        }
        for (int i = 0; i < rem; i++) scores[r + i] = even[i] + odd[i];
    }
}

/* acc[0:head_dim] += sum_j p[j] * v[j * v_stride + 0:head_dim] for j < width. */
static inline __attribute__((always_inline)) void accumulate_values(float *restrict acc, v16 p, int width,
                                                                    const float *restrict v, int v_stride,
                                                                    int head_dim) {
    int d = 0;
    for (; d + CHUNK <= head_dim; d += CHUNK) {
        v16 a = LOAD(acc + d);
        for (int j = 0; j < width; j++) a += p[j] * LOAD(v + (int64_t)j * v_stride + d);
        STORE(acc + d, a);
    }
    for (; d < head_dim; d++)
        for (int j = 0; j < width; j++) acc[d] += p[j] * v[(int64_t)j * v_stride + d];
}

/* Online-softmax update of every row with the 16 keys at positions key_pos.. (only
 * the first `width` exist); v + j * v_stride is key j's value row. Row r sits at
 * position positions[r] and sees keys in (positions[r] - window, positions[r]]. */
static void softmax_accumulate(Scratch *restrict sc, int rows, int head_dim, const int32_t *restrict positions,
                               int32_t window, int32_t key_pos, int width, const float *restrict v, int v_stride) {
    v16i lane;
    for (int j = 0; j < CHUNK; j++) lane[j] = j;
    for (int r = 0; r < rows; r++) {
        int32_t hi = positions[r] - key_pos; /* last visible lane */
        int32_t lo = window > 0 ? positions[r] - window + 1 - key_pos : 0; /* first visible lane */
        if (hi > width - 1) hi = width - 1;
        if (hi < 0 || lo > hi) continue;
        v16i visible = (lane >= lo) & (lane <= hi);
        v16 s = select_v16(visible, sc->scores[r], splat(MASKED));
        float old_max = sc->row_max[r];
        float chunk_max = hmax(s);
        float new_max = chunk_max > old_max ? chunk_max : old_max;
        v16 p = select_v16(visible, exp_v16(s - new_max), splat(0.0f));
        float *acc = sc->acc + r * head_dim;
        if (new_max > old_max) {
            float alpha = exp_v16(splat(old_max - new_max))[0];
            sc->row_sum[r] *= alpha;
            for (int d = 0; d < head_dim; d++) acc[d] *= alpha;
            sc->row_max[r] = new_max;
        }
        sc->row_sum[r] += p;
        /* Lanes past `width` are slots the sequence does not own (maybe garbage, even
         * NaN): never read them. A full chunk takes the constant-trip loop. */
        if (width == CHUNK)
            accumulate_values(acc, p, CHUNK, v, v_stride, head_dim);
        else
            accumulate_values(acc, p, width, v, v_stride, head_dim);
    }
}

static void run_task(const Task *t, Scratch *sc, const float *query, int64_t q_stride, const float *key_cache,
                     const float *value_cache, const int32_t *block_tables, int64_t table_stride,
                     const int32_t *seq_lens, const int32_t *query_start_loc, int num_heads,
                     int num_kv_heads, int head_dim, int block_size, float scale, int32_t window, float *out) {
    const int group = num_heads / num_kv_heads;
    const int32_t seq_len = seq_lens[t->seq];
    const int32_t q_start = query_start_loc[t->seq];
    const int32_t q_len = query_start_loc[t->seq + 1] - q_start;
    const int rows = (t->q_end - t->q_begin) * group;
    int32_t positions[MAX_TILE_ROWS];
    /* Row r = (query position i, head g of the group), i major. */
    for (int r = 0; r < rows; r++) {
        int i = t->q_begin + r / group, g = r % group;
        positions[r] = seq_len - q_len + i;
        const float *src = query + (int64_t)(q_start + i) * q_stride + (int64_t)(t->kv_head * group + g) * head_dim;
        for (int d = 0; d < head_dim; d++) sc->q[r * head_dim + d] = src[d] * scale;
        memset(sc->acc + r * head_dim, 0, sizeof(float) * head_dim);
        sc->row_max[r] = MASKED;
        sc->row_sum[r] = splat(0.0f);
    }
    const int32_t key_end = positions[rows - 1] + 1;
    const int32_t key_begin = window > 0 && positions[0] - window + 1 > 0 ? positions[0] - window + 1 : 0;
    const int32_t *table = block_tables + (int64_t)t->seq * table_stride;
    const int64_t k_block = (int64_t)num_kv_heads * head_dim * block_size;
    const int64_t v_block = (int64_t)num_kv_heads * block_size * head_dim;
    /* Blocks smaller than a chunk are copied into a 16-key staging chunk first. */
    float *k_stage = sc->k_stage, *v_stage = sc->v_stage;
    for (int32_t key_pos = key_begin - key_begin % CHUNK; key_pos < key_end; key_pos += CHUNK) {
        int width = key_end - key_pos < CHUNK ? key_end - key_pos : CHUNK;
        const float *k, *v;
        int k_stride;
        if (block_size >= CHUNK) {
            const int64_t phys = table[key_pos / block_size];
            const int c = key_pos % block_size;
            k = key_cache + phys * k_block + (int64_t)t->kv_head * head_dim * block_size + c;
            v = value_cache + phys * v_block + ((int64_t)t->kv_head * block_size + c) * head_dim;
            k_stride = block_size;
        } else {
            memset(k_stage, 0, sizeof(float) * head_dim * CHUNK);
            for (int j = 0; j < width; j++) {
                const int64_t phys = table[(key_pos + j) / block_size];
                const int o = (key_pos + j) % block_size;
                const float *kj = key_cache + phys * k_block + (int64_t)t->kv_head * head_dim * block_size + o;
                const float *vj = value_cache + phys * v_block + ((int64_t)t->kv_head * block_size + o) * head_dim;
                for (int d = 0; d < head_dim; d++) k_stage[d * CHUNK + j] = kj[(int64_t)d * block_size];
                memcpy(v_stage + j * head_dim, vj, sizeof(float) * head_dim);
            }
            k = k_stage, v = v_stage, k_stride = CHUNK;
        }
        score_chunk(sc->q, rows, head_dim, k, k_stride, sc->scores);
        softmax_accumulate(sc, rows, head_dim, positions, window, key_pos, width, v, head_dim);
    }
    for (int r = 0; r < rows; r++) {
        int i = t->q_begin + r / group, g = r % group;
        float *dst = out + ((int64_t)(q_start + i) * num_heads + t->kv_head * group + g) * head_dim;
        float total = hsum(sc->row_sum[r]);
        float inv = total > 0.0f ? 1.0f / total : 0.0f;
        for (int d = 0; d < head_dim; d++) dst[d] = sc->acc[r * head_dim + d] * inv;
    }
}

static int compare_tasks(const void *pa, const void *pb) {
    const Task *a = pa, *b = pb;
    if (a->kv_head != b->kv_head) return a->kv_head - b->kv_head;
    if (a->first_block != b->first_block) return a->first_block < b->first_block ? -1 : 1;
    if (a->seq != b->seq) return a->seq - b->seq;
    return b->q_end - a->q_end; /* later tiles see more keys: longest first */
}

/* Returns 0 on success, a negative code on bad arguments (checked again in Python). */
int paged_attention_f32(const float *query, int64_t q_stride, const float *key_cache, const float *value_cache,
                        const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                        const int32_t *query_start_loc, int32_t num_seqs, int32_t num_heads,
                        int32_t num_kv_heads, int32_t head_dim, int32_t block_size, float scale,
                        int32_t window, float *out, int32_t num_threads) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads || head_dim > MAX_HEAD_DIM || head_dim <= 0) return -1;
    const int group = num_heads / num_kv_heads;
    if (group > MAX_TILE_ROWS) return -2;
    const int positions_per_task = MAX_TILE_ROWS / group;
    int64_t num_tasks = 0;
    for (int s = 0; s < num_seqs; s++) {
        int q_len = query_start_loc[s + 1] - query_start_loc[s];
        num_tasks += (int64_t)num_kv_heads * ((q_len + positions_per_task - 1) / positions_per_task);
    }
    if (num_tasks == 0) return 0;
    Task *tasks = malloc(sizeof(Task) * num_tasks);
    if (!tasks) return -3;
    int64_t n = 0;
    for (int s = 0; s < num_seqs; s++) {
        int q_len = query_start_loc[s + 1] - query_start_loc[s];
        for (int q_end = q_len; q_end > 0; q_end -= positions_per_task) {
            int q_begin = q_end - positions_per_task > 0 ? q_end - positions_per_task : 0;
            for (int h = 0; h < num_kv_heads; h++) tasks[n++] = (Task){s, h, q_begin, q_end, block_tables[(int64_t)s * table_stride]};
        }
    }
    /* Run sequences that share a prefix (same first block) back to back, per KV head:
     * the shared blocks are then read from cache, not memory, by all but the first. */
    qsort(tasks, n, sizeof(Task), compare_tasks);
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        Scratch *sc = aligned_alloc(64, (sizeof(Scratch) + 63) / 64 * 64);
        if (!sc) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_tasks; i++) {
            if (sc)
                run_task(&tasks[i], sc, query, q_stride, key_cache, value_cache, block_tables, table_stride, seq_lens,
                         query_start_loc, num_heads, num_kv_heads, head_dim, block_size, scale, window, out);
        }
        free(sc);
    }
    free(tasks);
    return failed ? -3 : 0;
}

/* Store new tokens' K/V ([T, KVH, D], token rows k_stride / v_stride floats apart) at
 * their slots (slot = block * BS + offset); negative slots are padding and skipped. */
void write_kv_cache_f32(const float *key, int64_t k_stride, const float *value, int64_t v_stride,
                        float *key_cache, float *value_cache, const int64_t *slot_mapping, int64_t num_tokens,
                        int32_t num_kv_heads, int32_t head_dim, int32_t block_size) {
    const int64_t block_elems = (int64_t)num_kv_heads * head_dim * block_size;
    for (int64_t t = 0; t < num_tokens; t++) {
        int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        int64_t block = slot / block_size, offset = slot % block_size;
        for (int h = 0; h < num_kv_heads; h++) {
            const float *k = key + t * k_stride + (int64_t)h * head_dim;
            const float *v = value + t * v_stride + (int64_t)h * head_dim;
            float *kc = key_cache + block * block_elems + (int64_t)h * head_dim * block_size + offset;
            float *vc = value_cache + block * block_elems + ((int64_t)h * block_size + offset) * head_dim;
            for (int d = 0; d < head_dim; d++) kc[(int64_t)d * block_size] = k[d];
            memcpy(vc, v, sizeof(float) * head_dim);
        }
    }
}
