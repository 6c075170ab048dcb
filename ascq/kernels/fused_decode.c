// A whole decoder stack for one decode step (one token per sequence) in one call and one OpenMP region, compiled
// with the other kernels by ascq/kernels/native.py; driven by ascq/runtime/worker/fused_decode.py.
//
// Why it exists: at batch 1 a small model's eager layer is a few dozen torch ops and native calls from Python, which
// cost several times what streaming its int4 weights costs, so dispatch, not arithmetic, sets the step time. Here
// every layer runs rmsnorm -> qkv -> rotary -> paged KV write -> paged decode attention -> o_proj + residual ->
// rmsnorm -> an MLP with the same kernels (weight_only_mm.c, bf16_mm.c, paged_decode_attention.c) and the eager
// path's bf16 rounding points, so its results are the eager path's:
//   norms: torch's F.rms_norm on fp32 (squares summed in torch's order, ascq_torch_sum), rounded to bf16, times
//     the bf16 weight, rounded; residual adds and the rotary's products and sum rounded to bf16 after each op;
//   linears: the kernels' fp32 result (+ fp32 bias), rounded to bf16; dense bf16 weights see x converted to fp32;
//     W8A8 / W4A8 linears (int8_activations) round x to int8 as ascq_int8_activation_mm does;
//   silu: a table of torch's own bf16 silu for all 65536 inputs (built by the caller), then * up rounded to bf16;
//   attention: the native kernel on the fp32 query, rounded to bf16.
// The MLP is a Llama MLP (gate_up -> silu * up -> down), or a DeepSeek-MoE block (runtime/models/deepseek.py, the
// cpu backend's kernels/moe.py): the router's bf16 logits, torch's softmax + top-k (torch_cpu_ops.c); each chosen
// expert runs a Llama MLP on the rows routed to it (gathered in row order, one kernel call per expert as eager);
// each row's expert outputs times their weights are summed in fp32 in increasing expert order from 0 (eager's
// index_add_), rounded to bf16, plus the shared experts' MLP output, rounded.
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

// bf16(weight * bf16(rms_norm(fp32 x))) for one row; scratch: n floats.
static void rms_norm_row(const uint16_t *x, const uint16_t *weight, int n, float eps, float *scratch, uint16_t *out) {
    to_f32(x, scratch, n);
    float mean = ascq_torch_sum(scratch, n, 1) / (float)n;
    float r = 1.f / sqrtf(mean + eps);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 normed = round_bf16x8(_mm256_mul_ps(_mm256_loadu_ps(scratch + i), _mm256_set1_ps(r)));
        store_bf16x8(out + i, _mm256_mul_ps(bf16x8_to_f32(weight + i), normed));
    }
    for (; i < n; i++) out[i] = f32_to_bf16(bf16_to_f32(weight[i]) * bf16_to_f32(f32_to_bf16(scratch[i] * r)));
}

typedef struct {  // a linear's input as its kernel wants it
    int16_t *xq;  // int8 values instead where `takes_a8`
    int32_t *xsum;
    float *xscale, *xf;  // xscale: per row, or per row and group where `takes_a8`
} linear_input;

// Whether p's product over num_rows rows runs on 8-bit activations (as cpu.linear decides per call).
static int takes_a8(const ascq_fused_linear *p, int num_rows) {
    return p->kind == 4 && (p->int8_activations || (p->a8_min_rows > 0 && num_rows >= p->a8_min_rows));
}

static void prepare_input(const ascq_fused_linear *p, const uint16_t *x, int num_rows, const linear_input *in) {
    if (p->kind == 0) {
        to_f32(x, in->xf, (long)num_rows * p->k);
    } else if (p->int8_activations) {  // W8A8 / W4A8: as ascq_int8_activation_mm rounds them
        ascq_quantize_rows_int8(x, 1, num_rows, p->k, p->group_size, p->input_scale, p->input_zero_point,
                                p->kind == 4 ? 8 : 16, in->xq, in->xscale, in->xsum);
    } else if (takes_a8(p, num_rows)) {
        ascq_quantize_rows_a8(x, 1, num_rows, p->k, p->group_size, (int8_t *)in->xq, in->xscale, in->xsum);
    } else {
        ascq_quantize_rows(x, 1, num_rows, p->k, p->group_size, in->xq, in->xscale, in->xsum);
    }
}

// `base`'s buffers from row `first` on, rows laid out as p's input.
static linear_input input_rows(const linear_input *base, const ascq_fused_linear *p, int first) {
    size_t groups = p->kind == 0 ? 0 : (size_t)(p->k / p->group_size);
    return (linear_input){base->xq + (size_t)first * p->k, base->xsum + first * groups,
                          base->xscale + first * (groups ? groups : 1), base->xf + (size_t)first * p->k};
}

typedef struct {  // one linear's product over some rows
    const ascq_fused_linear *p;
    linear_input in;
    int num_rows;
    float *y;  // fp32 [num_rows, p->n]
} linear_task;

// Weight-only chunks as ascq_weight_only_mm splits them (long contiguous runs of weights).
#define BF16_CHUNK_COLUMNS 64
static int chunk_columns(const ascq_fused_linear *p, int num_threads) {
    return p->kind == 0 ? BF16_CHUNK_COLUMNS : ascq_weight_only_chunk_columns(p->n, num_threads);
}

static int chunks_of(const ascq_fused_linear *p, int num_threads) {
    int columns = chunk_columns(p, num_threads);
    return (p->n + columns - 1) / columns;
}

// Output columns [j0, j1) of a task's product.
static void task_columns(const linear_task *task, int j0, int j1) {
    const ascq_fused_linear *p = task->p;
    if (p->kind == 0)
        ascq_bf16_columns(task->in.xf, p->weight, task->y, task->num_rows, p->n, p->k, j0, j1);
    else
        ascq_weight_only_columns(task->in.xq, task->in.xsum, task->in.xscale, p->weight, p->kind,
                                 takes_a8(p, task->num_rows) ? 8 : 16, p->scales, p->scales_bf16, p->zeros,
                                 p->zeros_kind, task->y, task->num_rows, p->n, p->k, p->group_size, j0, j1);
}

// The output columns of the tasks' linears in chunks taken by whichever thread is free (on a shared machine a
// thread may be descheduled for a while; each column's result does not depend on the split), with the worksharing
// loop's barrier at the end. A MoE block's experts share one loop: at batch 1 that beats each thread taking whole
// experts (deepseek-moe-16b's shapes, 2 threads: 9 % less time per step).
static void linear_columns(const linear_task *tasks, int num_tasks) {
    int num_threads = omp_get_num_threads(), num_chunks = 0;
    for (int t = 0; t < num_tasks; t++) num_chunks += chunks_of(tasks[t].p, num_threads);
#pragma omp for schedule(dynamic)
    for (int c = 0; c < num_chunks; c++) {
        const linear_task *task = tasks;
        int chunk = c;
        for (; chunk >= chunks_of(task->p, num_threads); task++) chunk -= chunks_of(task->p, num_threads);
        int columns = chunk_columns(task->p, num_threads), j0 = chunk * columns;
        task_columns(task, j0, j0 + columns < task->p->n ? j0 + columns : task->p->n);
    }
}

static void one_linear(const ascq_fused_linear *p, const linear_input *in, int num_rows, float *y) {
    linear_task task = {p, *in, num_rows, y};
    linear_columns(&task, 1);
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
    if (p->int8_activations && (p->input_zero_point < -128 || p->input_zero_point > 127 ||
                                (p->kind == 4 && p->input_zero_point != 0)))
        return 0;
    return ascq_weight_only_shapes_ok(p->kind, k, p->group_size) && p->scales;
}

// A Llama MLP's gate_up [2 * inter, hidden] and down [hidden, inter].
static int mlp_ok(const ascq_fused_linear *gate_up, const ascq_fused_linear *down, int hidden) {
    return linear_ok(gate_up, 2 * down->k, hidden) && linear_ok(down, hidden, down->k);
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

// A Llama MLP's middle: its gate_up result y (fp32 [rows, 2 * inter]) -> bf16 -> silu(gate) * up (into h) -> down's
// input. act: bf16 [rows, 2 * inter] scratch.
static void mlp_middle(const ascq_fused_linear *gate_up, const ascq_fused_linear *down, const uint16_t *silu_table,
                       float *y, int num_rows, uint16_t *act, uint16_t *h, const linear_input *down_in) {
    int inter = down->k;
    linear_output(gate_up, y, num_rows, act);
    for (int b = 0; b < num_rows; b++) {
        const uint16_t *gate = act + (size_t)b * 2 * inter;
        silu_mul(gate, gate + inter, silu_table, inter, h + (size_t)b * inter);
    }
    prepare_input(down, h, num_rows, down_in);
}

static int moe_ok(const ascq_fused_moe *moe, int hidden) {
    if (moe->num_experts < 1 || moe->top_k < 1 || moe->top_k > 17 || moe->top_k > moe->num_experts ||
        (moe->lanes != 8 && moe->lanes != 16) || !linear_ok(&moe->router, moe->num_experts, hidden) ||
        !moe->gate_up || !moe->down)
        return 0;
    for (int e = 0; e < moe->num_experts; e++) {
        const ascq_fused_linear *gate_up = &moe->gate_up[e], *down = &moe->down[e];
        if (!mlp_ok(gate_up, down, hidden) || gate_up->kind != moe->gate_up[0].kind ||
            gate_up->group_size != moe->gate_up[0].group_size || down->k != moe->down[0].k)
            return 0;
    }
    return !moe->shared_gate_up.weight || mlp_ok(&moe->shared_gate_up, &moe->shared_down, hidden);
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
            !(L->moe ? moe_ok(L->moe, m->hidden) : mlp_ok(&L->gate_up, &L->down, m->hidden)) || !L->k_cache ||
            !L->v_cache)
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

typedef struct {  // the sizes a step's buffers are allocated for
    int widest;       // the widest linear input or output
    int max_experts;  // the most routed experts of a MoE block (0: none)
    int max_top_k;
} extents;

static int wider(int a, int b) { return a > b ? a : b; }

static int linear_width(const ascq_fused_linear *p) { return wider(p->n, p->k); }

static extents extents_of(const ascq_fused_model *m) {
    extents x = {m->hidden, 0, 0};
    for (int l = 0; l < m->num_layers; l++) {
        const ascq_fused_layer *L = &m->layers[l];
        const ascq_fused_moe *moe = L->moe;
        x.widest = wider(x.widest, wider(linear_width(&L->qkv), linear_width(&L->o)));
        if (!moe) {
            x.widest = wider(x.widest, wider(linear_width(&L->gate_up), linear_width(&L->down)));
            continue;
        }
        x.widest = wider(x.widest, wider(linear_width(&moe->router), linear_width(&moe->gate_up[0])));
        if (moe->shared_gate_up.weight) x.widest = wider(x.widest, linear_width(&moe->shared_gate_up));
        x.max_experts = wider(x.max_experts, moe->num_experts);
        x.max_top_k = wider(x.max_top_k, moe->top_k);
    }
    return x;
}

static void *alloc_array(size_t count, size_t size, int *failed) {
    void *p = malloc(count * size + 1);
    *failed |= !p;
    return p;
}

static void alloc_input(linear_input *in, size_t rows, int widest, int *failed) {
    in->xq = alloc_array(rows * widest, sizeof(int16_t), failed);
    in->xsum = alloc_array(rows * (widest / 32 + 1), sizeof(int32_t), failed);
    in->xscale = alloc_array(rows * (widest / 32 + 1), sizeof(float), failed);
    in->xf = alloc_array(rows * widest, sizeof(float), failed);
}

static void free_input(linear_input *in) { free(in->xq), free(in->xsum), free(in->xscale), free(in->xf); }

typedef struct {  // a MoE block's step: one slot per (row, chosen expert), grouped by expert in increasing order
    uint16_t *x, *act;  // bf16 [slots, widest]: an expert linear's input, output
    float *y;           // fp32 [slots, widest]
    linear_input in;    // [slots, widest]
    int *row;           // [slots]: the row a slot is for (increasing within an expert)
    float *weight;      // [slots]: its routing weight
    int *first;         // [max_experts]: an expert's first slot
    float *acc;         // fp32 [rows, hidden]: the weighted sum of a row's experts
    linear_input router_in;                // [rows, hidden]
    float *router_y;                       // fp32 [rows, max_experts]
    uint16_t *logits;                      // bf16 [rows, max_experts]
    float *route_scratch, *route_weights;  // 4 * max_experts; [rows, top_k]
    int32_t *route_ids;                    // [rows, top_k]
    linear_task first_tasks[2];            // the router's product, and the shared experts' gate_up
    int num_first;
    // [slots + 1]: the chosen experts' products (num_routed, their first slots), then the shared experts'
    linear_task *gate_up, *down;
    int *task_first;
    int num_routed, num_tasks;
} moe_step;

typedef struct {  // one step's buffers
    uint16_t *h, *act;  // bf16 [rows, widest]: a linear's input, output
    float *y;           // fp32 [rows, widest]
    linear_input in;    // [rows, widest]
    float *query, *attn;
    float *scratch;  // widest + head_dim
    moe_step moe;
} step_buffers;

static int alloc_step(step_buffers *s, const ascq_fused_model *m, extents x, int num_rows) {
    size_t rows = (size_t)num_rows, q_size = (size_t)m->num_heads * m->head_dim;
    size_t slots = rows * x.max_top_k, experts = x.max_experts;
    int failed = 0;
    s->h = alloc_array(rows * x.widest, sizeof(uint16_t), &failed);
    s->act = alloc_array(rows * x.widest, sizeof(uint16_t), &failed);
    s->y = alloc_array(rows * x.widest, sizeof(float), &failed);
    alloc_input(&s->in, rows, x.widest, &failed);
    s->query = alloc_array(rows * q_size, sizeof(float), &failed);
    s->attn = alloc_array(rows * q_size, sizeof(float), &failed);
    s->scratch = alloc_array(x.widest + m->head_dim, sizeof(float), &failed);
    moe_step *e = &s->moe;
    e->x = alloc_array(slots * x.widest, sizeof(uint16_t), &failed);
    e->act = alloc_array(slots * x.widest, sizeof(uint16_t), &failed);
    e->y = alloc_array(slots * x.widest, sizeof(float), &failed);
    alloc_input(&e->in, slots, x.widest, &failed);
    e->row = alloc_array(slots, sizeof(int), &failed);
    e->weight = alloc_array(slots, sizeof(float), &failed);
    e->first = alloc_array(experts, sizeof(int), &failed);
    e->acc = alloc_array(rows * m->hidden, sizeof(float), &failed);
    alloc_input(&e->router_in, rows, m->hidden, &failed);
    e->router_y = alloc_array(rows * experts, sizeof(float), &failed);
    e->logits = alloc_array(rows * experts, sizeof(uint16_t), &failed);
    e->route_scratch = alloc_array(4 * experts, sizeof(float), &failed);
    e->route_weights = alloc_array(slots, sizeof(float), &failed);
    e->route_ids = alloc_array(slots, sizeof(int32_t), &failed);
    e->gate_up = alloc_array(slots + 1, sizeof(linear_task), &failed);
    e->down = alloc_array(slots + 1, sizeof(linear_task), &failed);
    e->task_first = alloc_array(slots + 1, sizeof(int), &failed);
    return failed ? -1 : 0;
}

static void free_step(step_buffers *s) {
    moe_step *e = &s->moe;
    free(s->h), free(s->act), free(s->y), free_input(&s->in), free(s->query), free(s->attn), free(s->scratch);
    free(e->x), free(e->act), free(e->y), free_input(&e->in), free(e->row), free(e->weight), free(e->first);
    free(e->acc), free_input(&e->router_in), free(e->router_y), free(e->logits), free(e->route_scratch), free(e->route_weights), free(e->route_ids);
    free(e->gate_up), free(e->down), free(e->task_first);
}

// One thread, the block's input in s->h: the router's and the shared experts' gate_up inputs prepared, the first
// products' tasks (the router's columns are few: the shared experts' gate_up keeps the other threads busy).
static void moe_prepare(const ascq_fused_moe *moe, int num_rows, step_buffers *s) {
    moe_step *e = &s->moe;
    prepare_input(&moe->router, s->h, num_rows, &e->router_in);
    e->first_tasks[0] = (linear_task){&moe->router, e->router_in, num_rows, e->router_y};
    e->num_first = 1;
    if (moe->shared_gate_up.weight) {
        prepare_input(&moe->shared_gate_up, s->h, num_rows, &s->in);
        e->first_tasks[e->num_first++] = (linear_task){&moe->shared_gate_up, s->in, num_rows, s->y};
    }
}

// One thread, after the first products: the router's logits -> the rows each expert takes (slots) -> each chosen
// expert's input gathered and prepared, the products' task lists.
static void moe_route(const ascq_fused_moe *moe, int hidden, int num_rows, step_buffers *s) {
    moe_step *e = &s->moe;
    int k = moe->top_k, num_slots = num_rows * k;
    linear_output(&moe->router, e->router_y, num_rows, e->logits);
    ascq_moe_route_rows(e->logits, num_rows, moe->num_experts, k, moe->renormalize, moe->lanes, e->route_scratch,
                        e->route_weights, e->route_ids);
    memset(e->first, 0, sizeof(int) * moe->num_experts);
    for (int i = 0; i < num_slots; i++) e->first[e->route_ids[i]]++;
    for (int x = 0, end = 0; x < moe->num_experts; x++) end += e->first[x], e->first[x] = end;  // each one's end
    for (int i = num_slots - 1; i >= 0; i--) {  // from the end back to each one's first: rows in increasing order
        int slot = --e->first[e->route_ids[i]];
        e->row[slot] = i / k, e->weight[slot] = e->route_weights[i];
    }
    int t = 0;
    for (int x = 0; x < moe->num_experts; x++) {
        int first = e->first[x], rows = (x + 1 < moe->num_experts ? e->first[x + 1] : num_slots) - first;
        if (!rows) continue;
        const ascq_fused_linear *gate_up = &moe->gate_up[x], *down = &moe->down[x];
        for (int slot = first; slot < first + rows; slot++)
            memcpy(e->x + (size_t)slot * hidden, s->h + (size_t)e->row[slot] * hidden, sizeof(uint16_t) * hidden);
        linear_input in = input_rows(&e->in, gate_up, first);
        prepare_input(gate_up, e->x + (size_t)first * hidden, rows, &in);
        e->gate_up[t] = (linear_task){gate_up, in, rows, e->y + (size_t)first * gate_up->n};
        e->down[t] = (linear_task){down, input_rows(&e->in, down, first), rows, e->y + (size_t)first * down->n};
        e->task_first[t++] = first;
    }
    e->num_routed = e->num_tasks = t;
    if (moe->shared_gate_up.weight) {
        e->gate_up[t] = e->first_tasks[1];
        e->down[t] = (linear_task){&moe->shared_down, s->in, num_rows, s->y};
        e->num_tasks++;
    }
}

// One thread: out = bf16(bf16(each row's expert outputs (bf16) * their weights, summed in fp32 from 0 in increasing
// expert order) + the shared experts' output (bf16)).
static void moe_sum(const ascq_fused_moe *moe, int hidden, int num_rows, step_buffers *s, uint16_t *out) {
    moe_step *e = &s->moe;
    memset(e->acc, 0, sizeof(float) * num_rows * hidden);
    for (int t = 0; t < e->num_routed; t++) {
        const linear_task *down = &e->down[t];
        uint16_t *values = e->act + (size_t)e->task_first[t] * hidden;
        linear_output(down->p, down->y, down->num_rows, values);
        for (int r = 0; r < down->num_rows; r++) {
            int slot = e->task_first[t] + r;
            float *acc = e->acc + (size_t)e->row[slot] * hidden;
            const uint16_t *v = values + (size_t)r * hidden;
            __m256 w = _mm256_set1_ps(e->weight[slot]);
            int j = 0;
            for (; j + 8 <= hidden; j += 8)
                _mm256_storeu_ps(acc + j, _mm256_add_ps(_mm256_loadu_ps(acc + j),
                                                        _mm256_mul_ps(bf16x8_to_f32(v + j), w)));
            for (; j < hidden; j++) acc[j] += bf16_to_f32(v[j]) * e->weight[slot];
        }
    }
    to_bf16(e->acc, out, (long)num_rows * hidden);
    if (moe->shared_gate_up.weight) {
        linear_output(&moe->shared_down, s->y, num_rows, s->act);
        add_residual(s->act, out, (long)num_rows * hidden);
    }
}

// All threads, after moe_prepare: the router and the shared experts' gate_up, moe_route, the chosen experts'
// gate_up, then the chosen and the shared experts' middles and downs (each stage's columns shared out together),
// then moe_sum into out.
static void moe_block(const ascq_fused_moe *moe, const uint16_t *silu_table, int hidden, int num_rows,
                      step_buffers *s, uint16_t *out) {
    moe_step *e = &s->moe;
    linear_columns(e->first_tasks, e->num_first);
#pragma omp single
    moe_route(moe, hidden, num_rows, s);
    linear_columns(e->gate_up, e->num_routed);
#pragma omp for schedule(dynamic)
    for (int t = 0; t < e->num_tasks; t++) {
        const linear_task *gate_up = &e->gate_up[t], *down = &e->down[t];
        size_t first = t < e->num_routed ? e->task_first[t] : 0;
        uint16_t *act = t < e->num_routed ? e->act + first * gate_up->p->n : s->act;
        uint16_t *h = t < e->num_routed ? e->x + first * down->p->k : s->h;
        mlp_middle(gate_up->p, down->p, silu_table, gate_up->y, gate_up->num_rows, act, h, &down->in);
    }
    linear_columns(e->down, e->num_tasks);
#pragma omp single
    moe_sum(moe, hidden, num_rows, s, out);
}

// All threads: a Llama MLP of s->h (its input prepared in s->in) into out.
static void dense_mlp(const ascq_fused_layer *L, const uint16_t *silu_table, int num_rows, step_buffers *s,
                      uint16_t *out) {
    one_linear(&L->gate_up, &s->in, num_rows, s->y);
#pragma omp single
    mlp_middle(&L->gate_up, &L->down, silu_table, s->y, num_rows, s->act, s->h, &s->in);
    one_linear(&L->down, &s->in, num_rows, s->y);
#pragma omp single
    linear_output(&L->down, s->y, num_rows, out);
}

// One decode step through every layer and the final norm. x bf16 [M, hidden]: in, the embeddings; out, the final
// hidden states (the final norm of the last layer's output plus its residual stream). residual: scratch [M, hidden].
// cos, sin bf16 [M, head_dim] of each row's position. slot_mapping [M], block_tables int32 [M, max_blocks],
// seq_lens int32 [M] (this token included). Returns 0, or -1 on bad input.
int ascq_fused_decode(const ascq_fused_model *m, uint16_t *x, uint16_t *residual, int num_rows,
                      const int64_t *slot_mapping, const int32_t *block_tables, int max_blocks,
                      const int32_t *seq_lens, const uint16_t *cos, const uint16_t *sin, int num_threads) {
    if (num_threads < 1 || check_step(m, num_rows, slot_mapping, block_tables, max_blocks, seq_lens)) return -1;
    int hidden = m->hidden, head_dim = m->head_dim;
    int q_size = m->num_heads * head_dim, kv_size = m->num_kv_heads * head_dim, qkv_size = q_size + 2 * kv_size;
    int max_len = 0;
    int heads_per_task = ascq_attention_heads_per_task(num_rows, m->num_heads, num_threads);
    for (int b = 0; b < num_rows; b++) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    size_t rows = (size_t)num_rows;
    step_buffers s;
    int failed = alloc_step(&s, m, extents_of(m), num_rows);
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
                        rms_norm_row(residual + b * hidden, L->input_norm, hidden, m->eps, s.scratch, s.h + b * hidden);
                    prepare_input(&L->qkv, s.h, num_rows, &s.in);
                }
                one_linear(&L->qkv, &s.in, num_rows, s.y);
#pragma omp single
                {
                    linear_output(&L->qkv, s.y, num_rows, s.act);
                    for (int b = 0; b < num_rows; b++) {
                        uint16_t *row = s.act + (size_t)b * qkv_size;
                        rotate_row(row, m->num_heads + m->num_kv_heads, head_dim, cos + (size_t)b * head_dim,
                                   sin + (size_t)b * head_dim, (uint16_t *)s.scratch);
                        size_t slot = (size_t)slot_mapping[b] * kv_size;
                        memcpy(L->k_cache + slot, row + q_size, sizeof(uint16_t) * kv_size);
                        memcpy(L->v_cache + slot, row + q_size + kv_size, sizeof(uint16_t) * kv_size);
                        to_f32(row, s.query + (size_t)b * q_size, q_size);
                    }
                }
#pragma omp for schedule(dynamic)
                for (int task = 0; task < num_rows * (m->num_heads / heads_per_task); task++)
                    ascq_attend_task(task, heads_per_task, s.query, L->k_cache, L->v_cache, 1, block_tables,
                                     max_blocks, seq_lens, m->num_heads, m->num_kv_heads, head_dim, m->block_size,
                                     m->attn_scale, 1.f, 1.f, NULL, scores, s.attn);
#pragma omp single
                {
                    to_bf16(s.attn, s.h, (long)rows * q_size);
                    prepare_input(&L->o, s.h, num_rows, &s.in);
                }
                one_linear(&L->o, &s.in, num_rows, s.y);
#pragma omp single
                {
                    linear_output(&L->o, s.y, num_rows, s.act);
                    add_residual(s.act, residual, (long)rows * hidden);
                    for (int b = 0; b < num_rows; b++)
                        rms_norm_row(residual + b * hidden, L->post_norm, hidden, m->eps, s.scratch, s.h + b * hidden);
                    if (L->moe)
                        moe_prepare(L->moe, num_rows, &s);
                    else
                        prepare_input(&L->gate_up, s.h, num_rows, &s.in);
                }
                if (L->moe)
                    moe_block(L->moe, m->silu_table, hidden, num_rows, &s, x);
                else
                    dense_mlp(L, m->silu_table, num_rows, &s, x);
            }
#pragma omp single
            if (!failed) {
                add_residual(x, residual, (long)rows * hidden);
                for (int b = 0; b < num_rows; b++)
                    rms_norm_row(residual + b * hidden, m->final_norm, hidden, m->eps, s.scratch, x + b * hidden);
            }
            free(scores);
        }
    }
    free_step(&s);
    return failed ? -1 : 0;
}
