// Decode attention (one query token per sequence) straight from the paged KV cache, compiled with
// weight_only_mm.c by ascq/kernels/native.py.
//
// Why it exists: in torch the decode step gathers every sequence's context into padded [B, L, Hkv, D] copies, then
// transposes them for the batched products; at batch 64 that copying is most of a tiny model's step time (measured).
// Here each (sequence, kv head) walks its own block table once for K and once for V, reading rows in place.
// Math as in paged_sdpa._attend_decode: fp32 throughout, fp8 rows times their per-layer scale, softmax in fp32.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ascq_kernels.h"
#include "simd.h"

enum { CACHE_F32 = 0, CACHE_BF16 = 1, CACHE_F16 = 2, CACHE_FP8 = 3 };

// Row `offset` (in elements) of a cache as fp32 values times `scale` (scale used for fp8 only): the row itself for
// an fp32 cache, else converted into `buffer`.
static const float *load_row(const void *cache, int dtype, size_t offset, int head_dim, const float *fp8_values,
                             float scale, float *restrict buffer) {
    if (dtype == CACHE_F32) return (const float *)cache + offset;
    if (dtype == CACHE_BF16) {
        const uint16_t *row = (const uint16_t *)cache + offset;
        int i = 0;
        for (; i + 8 <= head_dim; i += 8) _mm256_storeu_ps(buffer + i, bf16x8_to_f32(row + i));
        for (; i < head_dim; i++) {
            uint32_t bits = (uint32_t)row[i] << 16;
            memcpy(buffer + i, &bits, sizeof bits);
        }
    } else if (dtype == CACHE_F16) {
        const uint16_t *row = (const uint16_t *)cache + offset;
        for (int i = 0; i < head_dim; i++) buffer[i] = _cvtsh_ss(row[i]);
    } else {
        const uint8_t *row = (const uint8_t *)cache + offset;
        for (int i = 0; i < head_dim; i++) buffer[i] = fp8_values[row[i]] * scale;
    }
    return buffer;
}

// q . k summed in one fixed order (8 lanes, then the lanes in a fixed tree, then the tail), whatever the pointers'
// alignment: a `#pragma omp simd` reduction may peel for alignment, so the same query attended from another buffer
// (fused_decode.c's) could round differently.
static inline float dot(const float *q, const float *k, int n) {
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + i), acc);
    float total = hsum8(acc);
    for (; i < n; i++) total += q[i] * k[i];
    return total;
}

// exp of 8 lanes (Cephes' expf polynomial, within 2 ulp of expf; inputs below -87.3, where expf is subnormal or 0,
// give 0). Used for every softmax lane, tails included, so a score's weight never depends on its position.
static inline __m256 exp8(__m256 x) {
    __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
    __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(tiny, _mm256_mul_ps(y, _mm256_castsi256_ps(power)));
}

// Softmax of s[0..n) in place: exp8 of s - max, then divided by their sum (8 lane sums, then the lanes in order).
static void softmax(float *s, int n) {
    float peak = -INFINITY;
    for (int pos = 0; pos < n; pos++) peak = fmaxf(peak, s[pos]);
    __m256 total8 = _mm256_setzero_ps(), shift = _mm256_set1_ps(peak);
    for (int pos = 0; pos < n; pos += 8) {
        float lanes[8] = {0};
        int width = n - pos < 8 ? n - pos : 8;
        memcpy(lanes, s + pos, sizeof(float) * width);
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(lanes), shift));
        if (width < 8) e = _mm256_and_ps(e, _mm256_castsi256_ps(_mm256_cmpgt_epi32(
                               _mm256_set1_epi32(width), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))));
        total8 = _mm256_add_ps(total8, e);
        _mm256_storeu_ps(lanes, e);
        memcpy(s + pos, lanes, sizeof(float) * width);
    }
    float lanes[8], total = 0.f;
    _mm256_storeu_ps(lanes, total8);
    for (int l = 0; l < 8; l++) total += lanes[l];
    int pos = 0;
    for (; pos + 8 <= n; pos += 8)
        _mm256_storeu_ps(s + pos, _mm256_div_ps(_mm256_loadu_ps(s + pos), _mm256_set1_ps(total)));
    for (; pos < n; pos++) s[pos] /= total;
}

#define BF16_DIM_CHUNK 64  // output dims of the bf16 path held in registers (8 vectors)

#define KEYS_AT_ONCE 4  // independent FMA chains: one key alone is bound by the FMA latency

// q . key * scale of `count` keys `stride` elements apart; each key's sum in the same order whatever `count` is.
static inline __attribute__((always_inline)) void key_scores(const float *q, const uint16_t *keys, size_t stride,
                                                             int count, int head_dim, float scale, float *out) {
    __m256 acc[KEYS_AT_ONCE];
    for (int c = 0; c < count; c++) acc[c] = _mm256_setzero_ps();
    for (int i = 0; i < head_dim; i += 8) {
        __m256 qi = _mm256_loadu_ps(q + i);
        for (int c = 0; c < count; c++) acc[c] = _mm256_fmadd_ps(qi, bf16x8_to_f32(keys + c * stride + i), acc[c]);
    }
    for (int c = 0; c < count; c++) out[c] = hsum8(acc[c]) * scale;
}

// Every cache line of kv heads [kv_head, kv_head + kv_count) over the first seq_len positions, requested up front:
// in a decode step the weights streamed since this layer's last step have evicted its cache. With this, 4 keys at
// once and one query head per work item, a cold-cache layer at batch 1 runs about twice as fast.
static void prefetch_rows(const uint16_t *cache, const int32_t *block_table, int seq_len, size_t row_stride,
                          int kv_head, int kv_count, int head_dim, int block_size) {
    size_t row_bytes = (size_t)kv_count * head_dim * sizeof(uint16_t);
    for (int pos = 0; pos < seq_len; pos++) {
        const char *row = (const char *)(cache + ((size_t)block_table[pos / block_size] * block_size +
                                                  pos % block_size) * row_stride + (size_t)kv_head * head_dim);
        for (size_t at = 0; at < row_bytes; at += 64) _mm_prefetch(row + at, _MM_HINT_T0);
        _mm_prefetch(row + row_bytes - 1, _MM_HINT_T0);
    }
}

// The bf16-cache path of attend_one (head_dim % 8 == 0) for kv heads [kv_head, kv_head + kv_count) of one sequence:
// keys and values read as bf16 in registers, no row copies, positions walked block by block, each head's scores
// KEYS_AT_ONCE keys at a time. Each head's arithmetic is the same whatever kv_count and group are (a head attended
// alone gives the same bits). query, out: the heads of those kv heads, in order; scores [kv_count * group * seq_len].
static void attend_bf16(const float *query, const uint16_t *k_cache, const uint16_t *v_cache,
                        const int32_t *block_table, int seq_len, int num_kv_heads, int kv_head, int kv_count,
                        int group, int head_dim, int block_size, float scale, float *scores, float *out) {
    size_t row_stride = (size_t)num_kv_heads * head_dim;
    int num_heads = kv_count * group;
    prefetch_rows(k_cache, block_table, seq_len, row_stride, kv_head, kv_count, head_dim, block_size);
    prefetch_rows(v_cache, block_table, seq_len, row_stride, kv_head, kv_count, head_dim, block_size);
    for (int pos0 = 0; pos0 < seq_len; pos0 += block_size) {
        const uint16_t *keys = k_cache + (size_t)block_table[pos0 / block_size] * block_size * row_stride +
                               (size_t)kv_head * head_dim;
        int end = seq_len - pos0 < block_size ? seq_len - pos0 : block_size;
        for (int head = 0; head < num_heads; head++) {
            const uint16_t *head_keys = keys + (size_t)(head / group) * head_dim;
            const float *q = query + (size_t)head * head_dim;
            float *head_scores = scores + (size_t)head * seq_len + pos0;
            int off = 0;
            for (; off + KEYS_AT_ONCE <= end; off += KEYS_AT_ONCE)
                key_scores(q, head_keys + off * row_stride, row_stride, KEYS_AT_ONCE, head_dim, scale,
                           head_scores + off);
            for (; off < end; off++)
                key_scores(q, head_keys + off * row_stride, row_stride, 1, head_dim, scale, head_scores + off);
        }
    }
    for (int head = 0; head < num_heads; head++) softmax(scores + (size_t)head * seq_len, seq_len);
    for (int head = 0; head < num_heads; head++) {
        const float *s = scores + (size_t)head * seq_len;
        for (int d0 = 0; d0 < head_dim; d0 += BF16_DIM_CHUNK) {
            int width = head_dim - d0 < BF16_DIM_CHUNK ? head_dim - d0 : BF16_DIM_CHUNK;
            __m256 acc[BF16_DIM_CHUNK / 8];
            for (int c = 0; c < width / 8; c++) acc[c] = _mm256_setzero_ps();
            for (int pos0 = 0; pos0 < seq_len; pos0 += block_size) {
                const uint16_t *values = v_cache + (size_t)block_table[pos0 / block_size] * block_size * row_stride +
                                         (size_t)(kv_head + head / group) * head_dim + d0;
                int end = seq_len - pos0 < block_size ? seq_len - pos0 : block_size;
                for (int off = 0; off < end; off++) {
                    const uint16_t *value = values + off * row_stride;
                    __m256 p = _mm256_set1_ps(s[pos0 + off]);
                    for (int c = 0; c < width / 8; c++)
                        acc[c] = _mm256_fmadd_ps(p, bf16x8_to_f32(value + 8 * c), acc[c]);
                }
            }
            for (int c = 0; c < width / 8; c++) _mm256_storeu_ps(out + (size_t)head * head_dim + d0 + 8 * c, acc[c]);
        }
    }
}

// One sequence, one kv head: its `group` query heads attend over the first seq_len cache positions.
static void attend_kv_head(const float *query, const void *k_cache, const void *v_cache, int dtype,
                           const int32_t *block_table, int seq_len, int num_kv_heads, int kv_head, int group,
                           int head_dim, int block_size, float scale, float k_scale, float v_scale,
                           const float *fp8_values, float *scores, float *row, float *out) {
    for (int pos = 0; pos < seq_len; pos++) {
        size_t slot = (size_t)block_table[pos / block_size] * block_size + pos % block_size;
        const float *key = load_row(k_cache, dtype, (slot * num_kv_heads + kv_head) * head_dim, head_dim, fp8_values,
                                    k_scale, row);
        for (int g = 0; g < group; g++) {
            scores[(size_t)g * seq_len + pos] = dot(query + (size_t)g * head_dim, key, head_dim) * scale;
        }
    }
    for (int g = 0; g < group; g++) softmax(scores + (size_t)g * seq_len, seq_len);
    memset(out, 0, sizeof(float) * group * head_dim);
    for (int pos = 0; pos < seq_len; pos++) {
        size_t slot = (size_t)block_table[pos / block_size] * block_size + pos % block_size;
        const float *value = load_row(v_cache, dtype, (slot * num_kv_heads + kv_head) * head_dim, head_dim,
                                      fp8_values, v_scale, row);
        for (int g = 0; g < group; g++) {
            float p = scores[(size_t)g * seq_len + pos], *o = out + (size_t)g * head_dim;
#pragma omp simd
            for (int i = 0; i < head_dim; i++) o[i] += p * value[i];
        }
    }
}

// One sequence, kv heads [kv_head, kv_head + kv_count): their query heads (query, out: [kv_count * group,
// head_dim]) attend over the first seq_len cache positions. scores [kv_count * group * seq_len], row [head_dim].
void ascq_attend_one(const float *query, const void *k_cache, const void *v_cache, int dtype,
                     const int32_t *block_table, int seq_len, int num_kv_heads, int kv_head, int kv_count, int group,
                     int head_dim, int block_size, float scale, float k_scale, float v_scale,
                     const float *fp8_values, float *scores, float *row, float *out) {
    if (dtype == CACHE_BF16 && head_dim % 8 == 0) {
        attend_bf16(query, k_cache, v_cache, block_table, seq_len, num_kv_heads, kv_head, kv_count, group, head_dim,
                    block_size, scale, scores, out);
        return;
    }
    for (int h = 0; h < kv_count; h++) {
        size_t first = (size_t)h * group;
        attend_kv_head(query + first * head_dim, k_cache, v_cache, dtype, block_table, seq_len, num_kv_heads,
                       kv_head + h, group, head_dim, block_size, scale, k_scale, v_scale, fp8_values,
                       scores + first * seq_len, row, out + first * head_dim);
    }
}

// Query heads per work item of a decode-attention call: all of a sequence's heads together (its cache rows hold its
// kv heads side by side) when there are enough sequences to keep every thread busy, else one head each (SmolLM2 at
// batch 1: 9 items over 2 threads instead of its 3 kv heads).
int ascq_attention_heads_per_task(int num_seqs, int num_heads, int num_threads) {
    return num_seqs >= 2 * num_threads ? num_heads : 1;
}

// Work item `task` of a call split by ascq_attention_heads_per_task: its query heads of query [B, H, D] attend,
// into out [B, H, D]. scores: room for heads_per_task * seq_len + head_dim floats.
void ascq_attend_task(int task, int heads_per_task, const float *query, const void *k_cache, const void *v_cache,
                      int dtype, const int32_t *block_tables, int max_blocks, const int32_t *seq_lens, int num_heads,
                      int num_kv_heads, int head_dim, int block_size, float scale, float k_scale, float v_scale,
                      const float *fp8_values, float *scores, float *out) {
    int tasks_per_seq = num_heads / heads_per_task, b = task / tasks_per_seq;
    int first = task % tasks_per_seq * heads_per_task, group = num_heads / num_kv_heads;
    // fewer heads than a group: their kv head as a group of that size (a head's arithmetic does not depend on
    // kv_count or group)
    int task_group = heads_per_task < group ? heads_per_task : group;
    size_t at = ((size_t)b * num_heads + first) * head_dim;
    ascq_attend_one(query + at, k_cache, v_cache, dtype, block_tables + (size_t)b * max_blocks, seq_lens[b],
                    num_kv_heads, first / group, heads_per_task / task_group, task_group, head_dim, block_size,
                    scale, k_scale, v_scale, fp8_values, scores, scores + (size_t)heads_per_task * seq_lens[b],
                    out + at);
}

// query fp32 [B, H, D] -> out fp32 [B, H, D]. Caches [num_blocks, block_size, Hkv, D] of `cache_dtype`
// (fp8: e4m3 bytes decoded through fp8_values[256]); block_tables int32 [B, max_blocks] of blocks below
// num_cache_blocks; seq_lens int32 [B] >= 1.
// Returns 0, or -1 on bad input.
int ascq_paged_decode_attention(const float *query, const void *k_cache, const void *v_cache, int cache_dtype,
                                int num_cache_blocks, const int32_t *block_tables, int max_blocks,
                                const int32_t *seq_lens, int num_seqs,
                                int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                                float k_scale, float v_scale, const float *fp8_values, float *out, int num_threads) {
    if (num_kv_heads < 1 || num_heads % num_kv_heads || cache_dtype < 0 || cache_dtype > 3 || num_threads < 1)
        return -1;
    for (int b = 0; b < num_seqs; b++) {
        if (seq_lens[b] < 1 || seq_lens[b] > max_blocks * block_size) return -1;
        for (int i = 0; i < (seq_lens[b] + block_size - 1) / block_size; i++) {
            int32_t block = block_tables[(size_t)b * max_blocks + i];
            if (block < 0 || block >= num_cache_blocks) return -1;
        }
    }
    int failed = 0, heads_per_task = ascq_attention_heads_per_task(num_seqs, num_heads, num_threads);
#pragma omp parallel for schedule(dynamic) num_threads(num_threads) reduction(| : failed)
    for (int task = 0; task < num_seqs * (num_heads / heads_per_task); task++) {
        int b = task / (num_heads / heads_per_task);
        float *scores = malloc(sizeof(float) * ((size_t)heads_per_task * seq_lens[b] + head_dim));
        if (!scores) {
            failed = 1;
            continue;
        }
        ascq_attend_task(task, heads_per_task, query, k_cache, v_cache, cache_dtype, block_tables, max_blocks,
                         seq_lens, num_heads, num_kv_heads, head_dim, block_size, scale, k_scale, v_scale, fp8_values,
                         scores, out);
        free(scores);
    }
    return failed ? -1 : 0;
}
