// A whole Llama decoder stack for one decode step (one token per sequence) in one call and one OpenMP region,
// compiled with the other kernels by ascq/kernels/native.py; driven by ascq/runtime/fused_decode.py.
//
// Why it exists: at batch 1 a small model's eager layer is a few dozen torch ops and native calls from Python,
// which cost several times what streaming its int4 weights costs, so dispatch, not arithmetic, sets the step time. Here every layer runs rmsnorm -> qkv -> rotary -> paged KV write -> paged decode attention -> o_proj +
// residual -> rmsnorm -> gate_up -> silu * up -> down with the same kernels (weight_only_mm.c, bf16_mm.c,
// paged_decode_attention.c) and the eager path's bf16 rounding points, so its results are the eager path's:
//   norms: torch's F.rms_norm on fp32 (squares summed in torch's order, see sum_squares), rounded to bf16, times
//     the bf16 weight, rounded; residual adds and the rotary's products and sum rounded to bf16 after each op;
//   linears: the kernels' fp32 result (+ fp32 bias), rounded to bf16; dense bf16 weights see x converted to fp32;
//   silu: a table of torch's own bf16 silu for all 65536 inputs (built by the caller), then * up rounded to bf16;
//   attention: the native kernel on the fp32 query, rounded to bf16.
// Only bf16 activations and a bf16 KV cache; the caller checks everything else (and falls back to eager).
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ascq_kernels.h"
#include "simd.h"

static inline float bf16_to_f32(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as c10::BFloat16
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if (isnan(f)) return 0x7fc0;
    return (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

static inline __m256 round_bf16x8(__m256 v) {  // bf16_to_f32(f32_to_bf16(v)) of 8 lanes
    uint16_t rounded[8];
    store_bf16x8(rounded, v);
    return bf16x8_to_f32(rounded);
}

static void to_f32(const uint16_t *x, float *out, long n) {
    long i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, bf16x8_to_f32(x + i));
    for (; i < n; i++) out[i] = bf16_to_f32(x[i]);
}

static void to_bf16(const float *x, uint16_t *out, long n) {
    long i = 0;
    for (; i + 8 <= n; i += 8) store_bf16x8(out + i, _mm256_loadu_ps(x + i));
    for (; i < n; i++) out[i] = f32_to_bf16(x[i]);
}

// Sum of x[i]^2 in the order of torch's CPU sum of a contiguous fp32 row (SumKernel.cpp: 8-lane vectors, 4 of them
// side by side, cascaded every 16 rows of 4, then the 4 combined, the scalar tail, the 8 lanes in order).
static float sum_squares(const float *x, int n) {
    enum { LANES = 8, ILP = 4, LEVELS = 4 };
    int num_vecs = n / LANES, num_rows = num_vecs / ILP;
    int ceil_log2 = 0;
    while ((1L << ceil_log2) < num_rows) ceil_log2++;
    int level_power = ceil_log2 / LEVELS > 4 ? ceil_log2 / LEVELS : 4;
    long level_step = 1L << level_power, level_mask = level_step - 1;
    float acc[LEVELS][ILP][LANES] = {{{0}}};
    long i = 0;
#define ADD_ROW(dst, row)                                                                                            \
    for (int k = 0; k < ILP; k++)                                                                                   \
        for (int l = 0; l < LANES; l++) {                                                                           \
            float v = x[((row)*ILP + k) * LANES + l];                                                               \
            dst[k][l] += v * v;                                                                                     \
        }
    while (i + level_step <= num_rows) {
        for (long j = 0; j < level_step; j++, i++) ADD_ROW(acc[0], i);
        for (int j = 1; j < LEVELS; j++) {
            for (int k = 0; k < ILP; k++)
                for (int l = 0; l < LANES; l++) acc[j][k][l] += acc[j - 1][k][l], acc[j - 1][k][l] = 0.f;
            if ((i & (level_mask << (j * level_power))) != 0) break;
        }
    }
    for (; i < num_rows; i++) ADD_ROW(acc[0], i);
#undef ADD_ROW
    for (int j = 1; j < LEVELS; j++)
        for (int k = 0; k < ILP; k++)
            for (int l = 0; l < LANES; l++) acc[0][k][l] += acc[j][k][l];
    for (int v = num_rows * ILP; v < num_vecs; v++)
        for (int l = 0; l < LANES; l++) acc[0][0][l] += x[v * LANES + l] * x[v * LANES + l];
    for (int k = 1; k < ILP; k++)
        for (int l = 0; l < LANES; l++) acc[0][0][l] += acc[0][k][l];
    float total = 0.f;
    for (int t = num_vecs * LANES; t < n; t++) total += x[t] * x[t];
    for (int l = 0; l < LANES; l++) total += acc[0][0][l];
    return total;
}

// bf16(weight * bf16(rms_norm(fp32 x))) for one row; scratch: n floats.
static void rms_norm_row(const uint16_t *x, const uint16_t *weight, int n, float eps, float *scratch, uint16_t *out) {
    to_f32(x, scratch, n);
    float mean = sum_squares(scratch, n) / (float)n;
    float r = 1.f / sqrtf(mean + eps);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 normed = round_bf16x8(_mm256_mul_ps(_mm256_loadu_ps(scratch + i), _mm256_set1_ps(r)));
        store_bf16x8(out + i, _mm256_mul_ps(bf16x8_to_f32(weight + i), normed));
    }
    for (; i < n; i++) out[i] = f32_to_bf16(bf16_to_f32(weight[i]) * bf16_to_f32(f32_to_bf16(scratch[i] * r)));
}

typedef struct {  // a linear's input as its kernel wants it
    int16_t *xq;
    int32_t *xsum;
    float *xscale, *xf;
} linear_input;

static void prepare_input(const ascq_fused_linear *p, const uint16_t *x, int num_rows, linear_input *in) {
    if (p->kind == 0) {
        to_f32(x, in->xf, (long)num_rows * p->k);
    } else {
        ascq_quantize_rows(x, 1, num_rows, p->k, p->group_size, in->xq, in->xscale, in->xsum);
    }
}

// The output columns in chunks taken by whichever thread is free (on a shared machine a thread may be descheduled
// for a while; each column's result does not depend on the split), with the worksharing loop's barrier at the end.
// Weight-only chunks as ascq_weight_only_mm splits them (long contiguous runs of weights).
#define BF16_CHUNK_COLUMNS 64
static void linear_columns(const ascq_fused_linear *p, const linear_input *in, int num_rows, float *y) {
    int chunk_columns =
        p->kind == 0 ? BF16_CHUNK_COLUMNS : ascq_weight_only_chunk_columns(p->n, omp_get_num_threads());
    int num_chunks = (p->n + chunk_columns - 1) / chunk_columns;
#pragma omp for schedule(dynamic)
    for (int c = 0; c < num_chunks; c++) {
        int j0 = c * chunk_columns, j1 = j0 + chunk_columns < p->n ? j0 + chunk_columns : p->n;
        if (p->kind == 0)
            ascq_bf16_columns(in->xf, p->weight, y, num_rows, p->n, p->k, j0, j1);
        else
            ascq_weight_only_columns(in->xq, in->xsum, in->xscale, p->weight, p->kind, p->scales, p->scales_bf16,
                                     p->zeros, p->zeros_kind, y, num_rows, p->n, p->k, p->group_size, j0, j1);
    }
}

static void linear_output(const ascq_fused_linear *p, float *y, int num_rows, uint16_t *out) {
    if (p->bias)
        for (int m = 0; m < num_rows; m++)
            for (int j = 0; j < p->n; j++) y[(size_t)m * p->n + j] += p->bias[j];
    to_bf16(y, out, (long)num_rows * p->n);
}

static int linear_ok(const ascq_fused_linear *p, int n, int k) {
    if (p->n != n || p->k != k || !p->weight) return 0;
    if (p->kind == 0) return k % 16 == 0;
    return ascq_weight_only_shapes_ok(p->kind, k, p->group_size) && p->scales;
}

// bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)) over heads [num_heads, head_dim] of one row, in place.
static void rotate_row(uint16_t *x, int num_heads, int head_dim, const uint16_t *cos, const uint16_t *sin,
                       uint16_t *scratch) {
    int half = head_dim / 2;
    for (int h = 0; h < num_heads; h++) {
        uint16_t *head = x + (size_t)h * head_dim;
        memcpy(scratch, head, sizeof(uint16_t) * head_dim);
        for (int i = 0; i < head_dim; i++) {
            float rotated = i < half ? -bf16_to_f32(scratch[i + half]) : bf16_to_f32(scratch[i - half]);
            float a = bf16_to_f32(f32_to_bf16(bf16_to_f32(scratch[i]) * bf16_to_f32(cos[i])));
            float b = bf16_to_f32(f32_to_bf16(rotated * bf16_to_f32(sin[i])));
            head[i] = f32_to_bf16(a + b);
        }
    }
}

static void add_residual(const uint16_t *x, uint16_t *residual, long count) {
    long i = 0;
    for (; i + 8 <= count; i += 8)
        store_bf16x8(residual + i, _mm256_add_ps(bf16x8_to_f32(x + i), bf16x8_to_f32(residual + i)));
    for (; i < count; i++) residual[i] = f32_to_bf16(bf16_to_f32(x[i]) + bf16_to_f32(residual[i]));
}

// bf16(silu(gate) * up) of one row, silu from the table (torch's own bf16 silu).
static void silu_mul(const uint16_t *gate, const uint16_t *up, const uint16_t *silu_table, int n, uint16_t *out) {
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        uint16_t silu[8];
        for (int l = 0; l < 8; l++) silu[l] = silu_table[gate[i + l]];
        store_bf16x8(out + i, _mm256_mul_ps(bf16x8_to_f32(silu), bf16x8_to_f32(up + i)));
    }
    for (; i < n; i++) out[i] = f32_to_bf16(bf16_to_f32(silu_table[gate[i]]) * bf16_to_f32(up[i]));
}

// Checks every layer's shapes and the step's cache addresses; 0 when all are valid.
static int check_step(const ascq_fused_model *m, int num_rows, const int64_t *slot_mapping,
                      const int32_t *block_tables, int max_blocks, const int32_t *seq_lens) {
    int q_size = m->num_heads * m->head_dim, kv_size = m->num_kv_heads * m->head_dim;
    if (m->num_kv_heads < 1 || m->num_heads % m->num_kv_heads || m->head_dim % 2 || num_rows < 1 || !m->final_norm)
        return -1;
    for (int l = 0; l < m->num_layers; l++) {
        const ascq_fused_layer *L = &m->layers[l];
        if (!linear_ok(&L->qkv, q_size + 2 * kv_size, m->hidden) || !linear_ok(&L->o, m->hidden, q_size) ||
            !linear_ok(&L->gate_up, 2 * m->intermediate, m->hidden) ||
            !linear_ok(&L->down, m->hidden, m->intermediate) || !L->k_cache || !L->v_cache)
            return -1;
    }
    long num_slots = (long)m->num_cache_blocks * m->block_size;
    for (int b = 0; b < num_rows; b++) {
        if (seq_lens[b] < 1 || seq_lens[b] > max_blocks * m->block_size) return -1;
        if (slot_mapping[b] < 0 || slot_mapping[b] >= num_slots) return -1;
        for (int i = 0; i < (seq_lens[b] + m->block_size - 1) / m->block_size; i++) {
            int32_t block = block_tables[(size_t)b * max_blocks + i];
            if (block < 0 || block >= m->num_cache_blocks) return -1;
        }
    }
    return 0;
}

// One decode step through every layer and the final norm. x bf16 [M, hidden]: in, the embeddings; out, the final
// hidden states (the final norm of the last layer's output plus its residual stream). residual: scratch [M, hidden].
// cos, sin bf16 [M, head_dim] of each row's position. slot_mapping [M], block_tables int32 [M, max_blocks],
// seq_lens int32 [M] (this token included). Returns 0, or -1 on bad input.
int ascq_fused_decode(const ascq_fused_model *m, uint16_t *x, uint16_t *residual, int num_rows,
                      const int64_t *slot_mapping, const int32_t *block_tables, int max_blocks,
                      const int32_t *seq_lens, const uint16_t *cos, const uint16_t *sin, int num_threads) {
    if (num_threads < 1 || check_step(m, num_rows, slot_mapping, block_tables, max_blocks, seq_lens)) return -1;
    int hidden = m->hidden, inter = m->intermediate, head_dim = m->head_dim;
    int q_size = m->num_heads * head_dim, kv_size = m->num_kv_heads * head_dim, qkv_size = q_size + 2 * kv_size;
    int max_len = 0;
    int heads_per_task = ascq_attention_heads_per_task(num_rows, m->num_heads, num_threads);
    for (int b = 0; b < num_rows; b++) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    int widest = qkv_size > 2 * inter ? qkv_size : 2 * inter;
    widest = widest > hidden ? widest : hidden;
    size_t rows = (size_t)num_rows;
    uint16_t *h = malloc(sizeof(uint16_t) * rows * widest);  // a linear's bf16 input
    uint16_t *act = malloc(sizeof(uint16_t) * rows * widest);  // a linear's bf16 output
    float *y = malloc(sizeof(float) * rows * widest);
    float *xf = malloc(sizeof(float) * rows * widest);
    int16_t *xq = malloc(sizeof(int16_t) * rows * widest);
    int32_t *xsum = malloc(sizeof(int32_t) * rows * (widest / 32 + 1));
    float *xscale = malloc(sizeof(float) * rows);
    float *query = malloc(sizeof(float) * rows * q_size);
    float *attn = malloc(sizeof(float) * rows * q_size);
    float *scratch = malloc(sizeof(float) * (widest + head_dim));
    int failed = !h || !act || !y || !xf || !xq || !xsum || !xscale || !query || !attn || !scratch;
    linear_input in = {xq, xsum, xscale, xf};
    if (!failed) {
#pragma omp parallel num_threads(num_threads)
        {
            float *scores = malloc(sizeof(float) * ((size_t)m->num_heads * max_len + head_dim));
            int mine_failed = !scores;
#pragma omp atomic
            failed |= mine_failed;
#pragma omp barrier
            for (int l = 0; l < m->num_layers && !failed; l++) {
                const ascq_fused_layer *L = &m->layers[l];
#pragma omp single
                {
                    if (l == 0)
                        memcpy(residual, x, sizeof(uint16_t) * rows * hidden);
                    else
                        add_residual(x, residual, (long)rows * hidden);
                    for (int b = 0; b < num_rows; b++)
                        rms_norm_row(residual + b * hidden, L->input_norm, hidden, m->eps, scratch, h + b * hidden);
                    prepare_input(&L->qkv, h, num_rows, &in);
                }
                linear_columns(&L->qkv, &in, num_rows, y);
#pragma omp single
                {
                    linear_output(&L->qkv, y, num_rows, act);
                    for (int b = 0; b < num_rows; b++) {
                        uint16_t *row = act + (size_t)b * qkv_size;
                        rotate_row(row, m->num_heads + m->num_kv_heads, head_dim, cos + (size_t)b * head_dim,
                                   sin + (size_t)b * head_dim, (uint16_t *)scratch);
                        size_t slot = (size_t)slot_mapping[b] * kv_size;
                        memcpy(L->k_cache + slot, row + q_size, sizeof(uint16_t) * kv_size);
                        memcpy(L->v_cache + slot, row + q_size + kv_size, sizeof(uint16_t) * kv_size);
                        to_f32(row, query + (size_t)b * q_size, q_size);
                    }
                }
#pragma omp for schedule(dynamic)
                for (int task = 0; task < num_rows * (m->num_heads / heads_per_task); task++)
                    ascq_attend_task(task, heads_per_task, query, L->k_cache, L->v_cache, 1, block_tables, max_blocks,
                                     seq_lens, m->num_heads, m->num_kv_heads, head_dim, m->block_size,
                                     m->attn_scale, 1.f, 1.f, NULL, scores, attn);
#pragma omp single
                {
                    to_bf16(attn, h, (long)rows * q_size);
                    prepare_input(&L->o, h, num_rows, &in);
                }
                linear_columns(&L->o, &in, num_rows, y);
#pragma omp single
                {
                    linear_output(&L->o, y, num_rows, act);
                    add_residual(act, residual, (long)rows * hidden);
                    for (int b = 0; b < num_rows; b++)
                        rms_norm_row(residual + b * hidden, L->post_norm, hidden, m->eps, scratch, h + b * hidden);
                    prepare_input(&L->gate_up, h, num_rows, &in);
                }
                linear_columns(&L->gate_up, &in, num_rows, y);
#pragma omp single
                {
                    linear_output(&L->gate_up, y, num_rows, act);
                    for (int b = 0; b < num_rows; b++) {
                        const uint16_t *gate = act + (size_t)b * 2 * inter;
                        silu_mul(gate, gate + inter, m->silu_table, inter, h + (size_t)b * inter);
                    }
                    prepare_input(&L->down, h, num_rows, &in);
                }
                linear_columns(&L->down, &in, num_rows, y);
#pragma omp single
                linear_output(&L->down, y, num_rows, x);
            }
#pragma omp single
            if (!failed) {
                add_residual(x, residual, (long)rows * hidden);
                for (int b = 0; b < num_rows; b++)
                    rms_norm_row(residual + b * hidden, m->final_norm, hidden, m->eps, scratch, x + b * hidden);
            }
            free(scores);
        }
    }
    free(h), free(act), free(y), free(xf), free(xq), free(xsum), free(xscale), free(query), free(attn), free(scratch);
    return failed ? -1 : 0;
}
