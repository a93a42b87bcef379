/* Paged attention and cache write for CPUs, float32, over a CPU-friendly KV layout.
 * The KV cache is float32, or fp8 e4m3 (one byte per element, with a per-tensor scale
 * each for K and V): fp8 rows are converted to float32 as they are staged for a chunk
 * of 16 keys (a 256-entry table, exact), K's scale is folded into the query's and
 * V's into the output; the cache write quantizes x / scale exactly as torch does
 * (round to nearest even through float32, saturated to +-448).
 *
 * Built at first use by kernels/cpu/library.py (cc -O3 -march=native -fopenmp) and
 * called through ctypes (kernels/cpu/attention.py): one call per layer per step runs every sequence of the step.
 *
 * Layouts (see kernels/cpu/attention.py):
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
 *
 * Decoding sequences that share leading blocks (prefix caching: one system prompt,
 * many requests) are grouped into one task per KV head, cascade style: the shared
 * keys are scored once for all the group's query rows, then each sequence goes on
 * alone over its own blocks. The online softmax carries each row across both parts,
 * so nothing is merged afterwards. When the groups make too few tasks for the threads
 * (one prompt, a handful of sequences), each group runs as several parts of its members.
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
/* The next chunk's keys and values are prefetched (into L2) while this one is scored: a
 * chunk is a block of its own (4 KB of keys, 4 KB of values for one KV head), somewhere in
 * the cache, and the hardware prefetcher does not cross into it (decode over 576-token
 * contexts: 0.61-0.65x the time; into L1 0.66-0.70x; two chunks ahead no better, four
 * worse). */
#define PREFETCH_CHUNKS 1
#define FP8_MAX 448.0f

/* fp8 e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities,
 * 0x7f/0xff are NaN; subnormals are m * 2^-9. */
static float fp8_to_f32_table[256];

__attribute__((constructor)) static void init_fp8_table(void) {
    for (int b = 0; b < 256; b++) {
        const int e = (b >> 3) & 15, m = b & 7;
        float v;
        if (e == 15 && m == 7)
            v = NAN;
        else if (e == 0)
            v = ldexpf((float)m, -9);
        else
            v = ldexpf(1.0f + (float)m / 8.0f, e - 7);
        fp8_to_f32_table[b] = (b & 0x80) ? -v : v;
    }
}

static inline uint32_t f32_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
}

static inline float f32_from_bits(uint32_t u) {
    float x;
    memcpy(&x, &u, 4);
    return x;
}

/* x (already divided by the scale) -> fp8 e4m3fn: saturated to +-448, then rounded
 * to nearest even; bit for bit c10's fp8e4m3fn_from_fp32_value (torch's .to()). */
static inline uint8_t f32_to_fp8(float x) {
    if (x > FP8_MAX) x = FP8_MAX;
    if (x < -FP8_MAX) x = -FP8_MAX;
    uint32_t bits = f32_bits(x);
    const uint32_t sign = bits & UINT32_C(0x80000000);
    bits ^= sign;
    uint8_t result;
    if (bits >= (UINT32_C(1087) << 20)) { /* NaN (finite values were clamped) */
        result = 0x7f;
    } else if (bits < (UINT32_C(121) << 23)) { /* below 2^-6: subnormal, rounded by a float add */
        const uint32_t denorm = UINT32_C(141) << 23;
        result = (uint8_t)(f32_bits(f32_from_bits(bits) + f32_from_bits(denorm)) - denorm);
    } else {
        const uint32_t mant_odd = (bits >> 20) & 1;
        bits += ((uint32_t)(7 - 127) << 23) + 0x7FFFF;
        bits += mant_odd;
        result = (uint8_t)(bits >> 20);
    }
    return result | (uint8_t)(sign >> 24);
}

typedef struct {
    int32_t kv_head;
    int32_t q_begin, q_end;     /* query positions [q_begin, q_end) of each member's new tokens */
    int32_t first, count;       /* members: sequence ids members[first .. first + count) */
    int32_t shared_keys;        /* keys [0, shared_keys) lie in blocks every member shares */
    int32_t sort_block;         /* sort key: the first member's first block */
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

/* Each thread's scratch (~330 KB), allocated on its first call and kept: the pool's
 * threads live as long as the process, and a fresh allocation per layer and step
 * would page-fault through it every time. */
static Scratch *thread_scratch(void) {
    static _Thread_local Scratch *scratch;
    if (!scratch) scratch = aligned_alloc(64, (sizeof(Scratch) + 63) / 64 * 64);
    return scratch;
}

/* Scores of `rows` query rows against the 16 keys whose dimension d is the 16 floats
 * at k + d * k_stride. Rows go eight at a time (a prefill tile's), then four, sharing each
 * loaded key vector: eight independent FMA chains keep both FMA units busy where four
 * leave them half idle on the chains' latency; the one to three left over are handled
 * below. */
static void score_chunk(const float *restrict q, int rows, int head_dim, const float *restrict k, int k_stride,
                        v16 *restrict scores) {
    int r = 0;
    for (; r + 8 <= rows; r += 8) {
        v16 s[8] = {{0}};
        const float *q0 = q + r * head_dim;
        for (int d = 0; d < head_dim; d++) {
            v16 kd = LOAD(k + (int64_t)d * k_stride);
            for (int i = 0; i < 8; i++) s[i] += q0[i * head_dim + d] * kd;
        }
        for (int i = 0; i < 8; i++) scores[r + i] = s[i];
    }
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

/* acc[0:head_dim] += sum_j p[j] * v[j * v_stride + 0:head_dim] for j < width.
 * Summing over j into one register would be one long chain of dependent FMAs;
 * instead 64 dimensions (four registers) are accumulated at once, even and odd keys
 * apart: eight independent chains. */
static inline __attribute__((always_inline)) void accumulate_values(float *restrict acc, v16 p, int width,
                                                                    const float *restrict v, int v_stride,
                                                                    int head_dim) {
    int d = 0;
    for (; d + 4 * CHUNK <= head_dim; d += 4 * CHUNK) {
        v16 e0 = LOAD(acc + d), e1 = LOAD(acc + d + CHUNK), e2 = LOAD(acc + d + 2 * CHUNK),
            e3 = LOAD(acc + d + 3 * CHUNK);
        v16 o0 = {0}, o1 = {0}, o2 = {0}, o3 = {0};
        int j = 0;
        for (; j + 2 <= width; j += 2) {
            const float *v0 = v + (int64_t)j * v_stride + d, *v1 = v0 + v_stride;
            const float p0 = p[j], p1 = p[j + 1];
            e0 += p0 * LOAD(v0), e1 += p0 * LOAD(v0 + CHUNK), e2 += p0 * LOAD(v0 + 2 * CHUNK);
            e3 += p0 * LOAD(v0 + 3 * CHUNK);
            o0 += p1 * LOAD(v1), o1 += p1 * LOAD(v1 + CHUNK), o2 += p1 * LOAD(v1 + 2 * CHUNK);
            o3 += p1 * LOAD(v1 + 3 * CHUNK);
        }
        if (j < width) {
            const float *v0 = v + (int64_t)j * v_stride + d;
            e0 += p[j] * LOAD(v0), e1 += p[j] * LOAD(v0 + CHUNK), e2 += p[j] * LOAD(v0 + 2 * CHUNK);
            e3 += p[j] * LOAD(v0 + 3 * CHUNK);
        }
        STORE(acc + d, e0 + o0), STORE(acc + d + CHUNK, e1 + o1), STORE(acc + d + 2 * CHUNK, e2 + o2);
        STORE(acc + d + 3 * CHUNK, e3 + o3);
    }
    for (; d + CHUNK <= head_dim; d += CHUNK) {
        v16 a[4] = {LOAD(acc + d), {0}, {0}, {0}};
        for (int j = 0; j < width; j++) a[j & 3] += p[j] * LOAD(v + (int64_t)j * v_stride + d);
        STORE(acc + d, (a[0] + a[1]) + (a[2] + a[3]));
    }
    for (; d < head_dim; d++)
        for (int j = 0; j < width; j++) acc[d] += p[j] * v[(int64_t)j * v_stride + d];
}

/* accumulate_values for `rows` (1 to 4, a constant where it is inlined) consecutive rows at
 * once: acc + i * head_dim += sum_j p[i * CHUNK + j] * v[j] for i < rows, over head_dim's
 * leading 64-dimension blocks. Each value vector loaded serves every row (up to sixteen
 * independent chains), where a row at a time loads it once per row: on a GQA group's
 * heads, or a prefill tile's positions, those loads were the bound. Returns the dimensions
 * done; the caller finishes the rest row by row. */
static inline __attribute__((always_inline)) int accumulate_rows(float *restrict acc, const float *restrict p,
                                                                 const int rows, int width, const float *restrict v,
                                                                 int v_stride, int head_dim) {
    int d = 0;
    for (; d + 4 * CHUNK <= head_dim; d += 4 * CHUNK) {
        v16 a[4][4];
        for (int i = 0; i < rows; i++)
            for (int b = 0; b < 4; b++) a[i][b] = LOAD(acc + i * head_dim + d + b * CHUNK);
        for (int j = 0; j < width; j++) {
            const float *vj = v + (int64_t)j * v_stride + d;
            const v16 v0 = LOAD(vj), v1 = LOAD(vj + CHUNK), v2 = LOAD(vj + 2 * CHUNK), v3 = LOAD(vj + 3 * CHUNK);
            for (int i = 0; i < rows; i++) {
                const float pij = p[i * CHUNK + j];
                a[i][0] += pij * v0, a[i][1] += pij * v1, a[i][2] += pij * v2, a[i][3] += pij * v3;
            }
        }
        for (int i = 0; i < rows; i++)
            for (int b = 0; b < 4; b++) STORE(acc + i * head_dim + d + b * CHUNK, a[i][b]);
    }
    return d;
}

/* Rows [r, r + rows) of the scratch: their weights (in place of their scores) times the
 * chunk's values, added to their accumulators. */
static inline __attribute__((always_inline)) void accumulate_chunk(Scratch *restrict sc, int r, const int rows,
                                                                   int width, const float *restrict v, int v_stride,
                                                                   int head_dim) {
    float *acc = sc->acc + r * head_dim;
    const float *p = (const float *)&sc->scores[r];
    /* A full chunk takes the constant-trip loop. */
    const int done = width == CHUNK ? accumulate_rows(acc, p, rows, CHUNK, v, v_stride, head_dim)
                                    : accumulate_rows(acc, p, rows, width, v, v_stride, head_dim);
    if (done < head_dim)
        for (int i = 0; i < rows; i++)
            accumulate_values(acc + i * head_dim + done, sc->scores[r + i], width, v + done, v_stride,
                              head_dim - done);
}

/* Online-softmax update of rows [r0, r1) with the 16 keys at positions key_pos..
 * (only the first `width` exist); v + j * v_stride is key j's value row. Row r sits
 * at position positions[r] and sees keys in [key_floor, positions[r]], and within
 * the window (positions[r] - window, positions[r]] when there is one. */
static void softmax_accumulate(Scratch *restrict sc, int r0, int r1, int head_dim, const int32_t *restrict positions,
                               int32_t window, int32_t key_floor, int32_t key_pos, int width, const float *restrict v,
                               int v_stride) {
    v16i lane;
    for (int j = 0; j < CHUNK; j++) lane[j] = j;
    /* First each row's weights, in place of its scores (0 where it sees no key), its running
     * max and sum, and its accumulator rescaled; then the weighted values, four rows at a
     * time. Lanes past `width` are slots the sequence does not own (maybe garbage, even
     * NaN): never read them. */
    for (int r = r0; r < r1; r++) {
        int32_t hi = positions[r] - key_pos; /* last visible lane */
        int32_t lo = key_floor - key_pos;    /* first visible lane */
        if (window > 0 && positions[r] - window + 1 - key_pos > lo) lo = positions[r] - window + 1 - key_pos;
        if (hi > width - 1) hi = width - 1;
        if (hi < 0 || lo > hi) {
            sc->scores[r] = splat(0.0f);
            continue;
        }
        v16i visible = (lane >= lo) & (lane <= hi);
        v16 s = select_v16(visible, sc->scores[r], splat(MASKED));
        float old_max = sc->row_max[r];
        float chunk_max = hmax(s);
        float new_max = chunk_max > old_max ? chunk_max : old_max;
        v16 p = select_v16(visible, exp_v16(s - new_max), splat(0.0f));
        if (new_max > old_max) {
            float alpha = exp_v16(splat(old_max - new_max))[0];
            float *acc = sc->acc + r * head_dim;
            sc->row_sum[r] *= alpha;
            for (int d = 0; d < head_dim; d++) acc[d] *= alpha;
            sc->row_max[r] = new_max;
        }
        sc->row_sum[r] += p;
        sc->scores[r] = p;
    }
    int r = r0;
    for (; r + 4 <= r1; r += 4) accumulate_chunk(sc, r, 4, width, v, v_stride, head_dim);
    switch (r1 - r) {
        case 3: accumulate_chunk(sc, r, 3, width, v, v_stride, head_dim); break;
        case 2: accumulate_chunk(sc, r, 2, width, v, v_stride, head_dim); break;
        case 1: accumulate_chunk(sc, r, 1, width, v, v_stride, head_dim); break;
        default: break;
    }
}

typedef struct {
    const void *key_cache, *value_cache; /* float, or uint8_t (fp8 e4m3) when fp8 */
    const int32_t *block_tables;
    int64_t table_stride;
    int num_kv_heads, head_dim, block_size;
    int32_t window;
    int fp8;
    float k_scale, v_scale; /* fp8 only (1 otherwise) */
} CacheView;

/* Where key position `pos` of the sequence whose block table is `table` starts in a float32
 * cache: its key (the 16 keys from it at stride block_size per dimension) and its value row. */
static inline const float *key_at(const CacheView *c, const int32_t *table, int kv_head, int32_t pos) {
    const int64_t block = (int64_t)c->num_kv_heads * c->head_dim * c->block_size;
    return (const float *)c->key_cache + table[pos / c->block_size] * block +
           (int64_t)kv_head * c->head_dim * c->block_size + pos % c->block_size;
}

static inline const float *value_at(const CacheView *c, const int32_t *table, int kv_head, int32_t pos) {
    const int64_t block = (int64_t)c->num_kv_heads * c->block_size * c->head_dim;
    return (const float *)c->value_cache + table[pos / c->block_size] * block +
           ((int64_t)kv_head * c->block_size + pos % c->block_size) * c->head_dim;
}

/* Rows [r0, r1) over keys [key_begin, key_end) of the sequence whose block table is
 * `table`; keys below key_floor are left out (another pass covered them). */
static void attend_keys(Scratch *sc, int r0, int r1, const int32_t *positions, const CacheView *c,
                        const int32_t *table, int kv_head, int32_t key_floor, int32_t key_begin, int32_t key_end) {
    const int head_dim = c->head_dim, block_size = c->block_size;
    const int64_t k_block = (int64_t)c->num_kv_heads * head_dim * block_size;
    const int64_t v_block = (int64_t)c->num_kv_heads * block_size * head_dim;
    /* Blocks smaller than a chunk are copied into a 16-key staging chunk first. */
    float *k_stage = sc->k_stage, *v_stage = sc->v_stage;
    for (int32_t key_pos = key_begin - key_begin % CHUNK; key_pos < key_end; key_pos += CHUNK) {
        int width = key_end - key_pos < CHUNK ? key_end - key_pos : CHUNK;
        const float *k, *v;
        int k_stride;
        if (c->fp8) {
            /* fp8 rows converted to float as they are staged (the scales are applied elsewhere). */
            const uint8_t *kc = c->key_cache, *vc = c->value_cache;
            if (width < CHUNK) memset(k_stage, 0, sizeof(float) * head_dim * CHUNK);
            for (int j = 0; j < width; j++) {
                const int64_t phys = table[(key_pos + j) / block_size];
                const int off = (key_pos + j) % block_size;
                const uint8_t *kj = kc + phys * k_block + (int64_t)kv_head * head_dim * block_size + off;
                const uint8_t *vj = vc + phys * v_block + ((int64_t)kv_head * block_size + off) * head_dim;
                for (int d = 0; d < head_dim; d++) k_stage[d * CHUNK + j] = fp8_to_f32_table[kj[(int64_t)d * block_size]];
                for (int d = 0; d < head_dim; d++) v_stage[j * head_dim + d] = fp8_to_f32_table[vj[d]];
            }
            k = k_stage, v = v_stage, k_stride = CHUNK;
        } else if (block_size >= CHUNK) {
            k = key_at(c, table, kv_head, key_pos);
            v = value_at(c, table, kv_head, key_pos);
            k_stride = block_size;
            const int32_t ahead = key_pos + PREFETCH_CHUNKS * CHUNK;
            if (ahead < key_end) {
                const float *ka = key_at(c, table, kv_head, ahead), *va = value_at(c, table, kv_head, ahead);
                for (int d = 0; d < head_dim; d++) __builtin_prefetch(ka + (int64_t)d * block_size, 0, 2);
                for (int i = 0; i < CHUNK * head_dim; i += VEC) __builtin_prefetch(va + i, 0, 2);
            }
        } else {
            memset(k_stage, 0, sizeof(float) * head_dim * CHUNK);
            for (int j = 0; j < width; j++) {
                const float *kj = key_at(c, table, kv_head, key_pos + j), *vj = value_at(c, table, kv_head, key_pos + j);
                for (int d = 0; d < head_dim; d++) k_stage[d * CHUNK + j] = kj[(int64_t)d * block_size];
                memcpy(v_stage + j * head_dim, vj, sizeof(float) * head_dim);
            }
            k = k_stage, v = v_stage, k_stride = CHUNK;
        }
        score_chunk(sc->q + r0 * head_dim, r1 - r0, head_dim, k, k_stride, sc->scores + r0);
        softmax_accumulate(sc, r0, r1, head_dim, positions, c->window, key_floor, key_pos, width, v, head_dim);
    }
}

static void run_task(const Task *t, Scratch *sc, const int32_t *members, const float *query, int64_t q_stride,
                     const CacheView *c, const int32_t *seq_lens, const int32_t *query_start_loc, int num_heads,
                     float scale, float *out) {
    const int head_dim = c->head_dim;
    const int group = num_heads / c->num_kv_heads;
    const int tile = t->q_end - t->q_begin;
    const int rows_per_member = tile * group;
    const int rows = t->count * rows_per_member;
    int32_t positions[MAX_TILE_ROWS];
    const float q_scale = scale * c->k_scale, o_scale = c->v_scale;
    /* Row r = (member m, query position i, head g of the group), m then i major. */
    for (int r = 0; r < rows; r++) {
        const int m = r / rows_per_member, i = t->q_begin + (r % rows_per_member) / group, g = r % group;
        const int seq = members[t->first + m];
        const int32_t q_start = query_start_loc[seq], q_len = query_start_loc[seq + 1] - q_start;
        positions[r] = seq_lens[seq] - q_len + i;
        const float *src = query + (int64_t)(q_start + i) * q_stride + (int64_t)(t->kv_head * group + g) * head_dim;
        for (int d = 0; d < head_dim; d++) sc->q[r * head_dim + d] = src[d] * q_scale;
        memset(sc->acc + r * head_dim, 0, sizeof(float) * head_dim);
        sc->row_max[r] = MASKED;
        sc->row_sum[r] = splat(0.0f);
    }
    /* The shared keys once for every row (all of them see all shared keys)... */
    if (t->shared_keys > 0)
        attend_keys(sc, 0, rows, positions, c, c->block_tables + (int64_t)members[t->first] * c->table_stride,
                    t->kv_head, 0, 0, t->shared_keys);
    /* ...then each member alone over the rest of its context. */
    for (int m = 0; m < t->count; m++) {
        const int r0 = m * rows_per_member, r1 = r0 + rows_per_member;
        const int32_t key_end = positions[r1 - 1] + 1;
        int32_t key_begin = t->shared_keys;
        if (c->window > 0 && positions[r0] - c->window + 1 > key_begin) key_begin = positions[r0] - c->window + 1;
        attend_keys(sc, r0, r1, positions, c, c->block_tables + (int64_t)members[t->first + m] * c->table_stride,
                    t->kv_head, t->shared_keys, key_begin, key_end);
    }
    for (int r = 0; r < rows; r++) {
        const int m = r / rows_per_member, i = t->q_begin + (r % rows_per_member) / group, g = r % group;
        const int seq = members[t->first + m];
        float *dst = out + ((int64_t)(query_start_loc[seq] + i) * num_heads + t->kv_head * group + g) * head_dim;
        float total = hsum(sc->row_sum[r]);
        float inv = total > 0.0f ? o_scale / total : 0.0f;
        for (int d = 0; d < head_dim; d++) dst[d] = sc->acc[r * head_dim + d] * inv;
    }
}

static int compare_tasks(const void *pa, const void *pb) {
    const Task *a = pa, *b = pb;
    if (a->kv_head != b->kv_head) return a->kv_head - b->kv_head;
    if (a->sort_block != b->sort_block) return a->sort_block < b->sort_block ? -1 : 1;
    if (a->first != b->first) return a->first - b->first;
    return b->q_end - a->q_end; /* later tiles see more keys: longest first */
}

/* Decoding sequences ordered by their block table (lexicographically), so those
 * sharing leading blocks are adjacent. qsort has no context argument: each entry
 * carries a pointer to its table row. */
typedef struct {
    const int32_t *table;
    int32_t blocks; /* table entries the sequence uses */
    int32_t seq;
} SeqRef;

static int compare_seqs(const void *pa, const void *pb) {
    const SeqRef *a = pa, *b = pb;
    const int32_t n = a->blocks < b->blocks ? a->blocks : b->blocks;
    for (int32_t i = 0; i < n; i++)
        if (a->table[i] != b->table[i]) return a->table[i] < b->table[i] ? -1 : 1;
    if (a->blocks != b->blocks) return a->blocks - b->blocks;
    return a->seq - b->seq;
}

static int32_t common_blocks(const SeqRef *a, const SeqRef *b) {
    const int32_t n = a->blocks < b->blocks ? a->blocks : b->blocks;
    int32_t i = 0;
    while (i < n && a->table[i] == b->table[i]) i++;
    return i;
}

/* Returns 0 on success, a negative code on bad arguments (checked again in Python).
 * kv_fp8: the caches hold fp8 e4m3 bytes, dequantized with k_scale / v_scale;
 * else float32 (the scales must then be 1). */
int paged_attention_f32(const float *query, int64_t q_stride, const void *key_cache, const void *value_cache,
                        const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                        const int32_t *query_start_loc, int32_t num_seqs, int32_t num_heads,
                        int32_t num_kv_heads, int32_t head_dim, int32_t block_size, float scale,
                        int32_t window, float *out, int32_t num_threads, int32_t kv_fp8, float k_scale,
                        float v_scale) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads || head_dim > MAX_HEAD_DIM || head_dim <= 0) return -1;
    const int group = num_heads / num_kv_heads;
    if (group > MAX_TILE_ROWS) return -2;
    const int positions_per_task = MAX_TILE_ROWS / group;
    const int max_members = MAX_TILE_ROWS / group;
    Task *tasks = malloc(sizeof(Task) * ((int64_t)num_kv_heads * ((int64_t)num_seqs + query_start_loc[num_seqs]) + 1));
    int32_t *members = malloc(sizeof(int32_t) * (num_seqs + 1));
    SeqRef *decoding = malloc(sizeof(SeqRef) * (num_seqs + 1));
    int32_t *group_end = malloc(sizeof(int32_t) * (num_seqs + 1)), *group_shared = malloc(sizeof(int32_t) * (num_seqs + 1));
    if (!tasks || !members || !decoding || !group_end || !group_shared) {
        free(tasks), free(members), free(decoding), free(group_end), free(group_shared);
        return -3;
    }
    int64_t n = 0;
    int32_t num_members = 0, num_decoding = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int q_len = query_start_loc[s + 1] - query_start_loc[s];
        if (q_len == 1 && window == 0) {
            const int32_t *table = block_tables + (int64_t)s * table_stride;
            decoding[num_decoding++] = (SeqRef){table, (seq_lens[s] + block_size - 1) / block_size, s};
            continue;
        }
        /* A prefill chunk (or a decode under a sliding window): its own tiles. */
        const int32_t me = num_members;
        members[num_members++] = s;
        for (int q_end = q_len; q_end > 0; q_end -= positions_per_task) {
            const int q_begin = q_end - positions_per_task > 0 ? q_end - positions_per_task : 0;
            for (int h = 0; h < num_kv_heads; h++)
                tasks[n++] = (Task){h, q_begin, q_end, me, 1, 0, block_tables[(int64_t)s * table_stride]};
        }
    }
    qsort(decoding, num_decoding, sizeof(SeqRef), compare_seqs);
    /* Groups: the next sequences with at least one block in common with the first. */
    int32_t num_groups = 0;
    for (int32_t i = 0; i < num_decoding; num_groups++) {
        int32_t end = i + 1, shared = decoding[i].blocks;
        while (end < num_decoding && end - i < max_members) {
            const int32_t common = common_blocks(&decoding[i], &decoding[end]);
            if (common == 0) break;
            shared = common < shared ? common : shared;
            end++;
        }
        int32_t shared_keys = 0;
        if (end - i > 1) {
            /* Keys in the shared blocks that every member holds (a shared block may be
             * partly filled: copy-on-write children before their first own token). */
            shared_keys = shared * block_size;
            for (int32_t j = i; j < end; j++)
                if (seq_lens[decoding[j].seq] < shared_keys) shared_keys = seq_lens[decoding[j].seq];
        }
        group_end[num_groups] = end, group_shared[num_groups] = shared_keys;
        i = end;
    }
    /* Few groups (one system prompt, a handful of sequences) make fewer tasks than the
     * threads can balance (with the prefill tiles, two a thread): 8 sequences of one prefix over 3 KV heads are 3 tasks, one
     * thread of 2 doing two. Each group's members are then split into parts, each part
     * a task per KV head still reading the shared keys once for its rows: the score
     * and value work is per row either way; a part only loads the shared blocks again,
     * from cache. */
    int32_t parts_wanted = 1;
    const int64_t group_tasks = (int64_t)num_groups * num_kv_heads, wanted = 2 * (int64_t)num_threads - n;
    if (group_tasks > 0 && wanted > group_tasks) parts_wanted = (int32_t)((wanted + group_tasks - 1) / group_tasks);
    for (int32_t g = 0, i = 0; g < num_groups; g++) {
        const int32_t end = group_end[g], size = end - i;
        const int32_t parts = parts_wanted < size ? parts_wanted : size;
        for (int32_t j = i; j < end; j++) members[num_members + j - i] = decoding[j].seq;
        for (int32_t part = 0; part < parts; part++) {
            const int32_t lo = size * part / parts, hi = size * (part + 1) / parts;
            for (int h = 0; h < num_kv_heads; h++)
                tasks[n++] = (Task){h, 0, 1, num_members + lo, hi - lo, hi - lo > 1 ? group_shared[g] : 0,
                                    decoding[i].table[0]};
        }
        num_members += size;
        i = end;
    }
    free(group_end), free(group_shared);
    free(decoding);
    /* Per KV head, tasks on the same leading block run back to back, so the blocks
     * they share are read from cache, not memory, by all but the first. */
    qsort(tasks, n, sizeof(Task), compare_tasks);
    const CacheView cache = {key_cache, value_cache, block_tables, table_stride, num_kv_heads, head_dim, block_size,
                             window, kv_fp8 != 0, kv_fp8 ? k_scale : 1.0f, kv_fp8 ? v_scale : 1.0f};
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        Scratch *sc = thread_scratch();
        if (!sc) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n; i++) {
            if (sc) run_task(&tasks[i], sc, members, query, q_stride, &cache, seq_lens, query_start_loc, num_heads, scale, out);
        }
    }
    free(tasks);
    free(members);
    return failed ? -3 : 0;
}

/* Store new tokens' K/V ([T, KVH, D], token rows k_stride / v_stride floats apart) at
 * their slots (slot = block * BS + offset); negative slots are padding and skipped.
 * Returns 0, or -1 (writing nothing) when a slot lies outside the cache's num_slots. */
int write_kv_cache_f32(const float *key, int64_t k_stride, const float *value, int64_t v_stride, float *key_cache,
                       float *value_cache, const int64_t *slot_mapping, int64_t num_tokens, int64_t num_slots,
                       int32_t num_kv_heads, int32_t head_dim, int32_t block_size) {
    for (int64_t t = 0; t < num_tokens; t++)
        if (slot_mapping[t] >= num_slots) return -1;
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
    return 0;
}

/* The same store into an fp8 e4m3 cache (uint8 bytes in the same layouts): each element
 * is x / scale (IEEE float32 division) saturated and rounded by f32_to_fp8. */
int write_kv_cache_fp8(const float *key, int64_t k_stride, const float *value, int64_t v_stride, uint8_t *key_cache,
                       uint8_t *value_cache, const int64_t *slot_mapping, int64_t num_tokens, int64_t num_slots,
                       int32_t num_kv_heads, int32_t head_dim, int32_t block_size, float k_scale, float v_scale) {
    for (int64_t t = 0; t < num_tokens; t++)
        if (slot_mapping[t] >= num_slots) return -1;
    const int64_t block_elems = (int64_t)num_kv_heads * head_dim * block_size;
    for (int64_t t = 0; t < num_tokens; t++) {
        int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        int64_t block = slot / block_size, offset = slot % block_size;
        for (int h = 0; h < num_kv_heads; h++) {
            const float *k = key + t * k_stride + (int64_t)h * head_dim;
            const float *v = value + t * v_stride + (int64_t)h * head_dim;
            uint8_t *kc = key_cache + block * block_elems + (int64_t)h * head_dim * block_size + offset;
            uint8_t *vc = value_cache + block * block_elems + ((int64_t)h * block_size + offset) * head_dim;
            for (int d = 0; d < head_dim; d++) kc[(int64_t)d * block_size] = f32_to_fp8(k[d] / k_scale);
            for (int d = 0; d < head_dim; d++) vc[d] = f32_to_fp8(v[d] / v_scale);
        }
    }
    return 0;
}
