// The ABI of ascq's native CPU kernels, declared once. Every .c file includes it; ascq/kernels/native.py reads the
// ASCQ_API prototypes (its ctypes signatures) and the ascq_fused_* structs (runtime/worker/fused_decode.py's ctypes
// structures) from this file, so a signature lives here and nowhere else. Types the Python side reads: int, float,
// and pointers (a void pointer to ctypes, or a POINTER to a struct declared here). The other prototypes are shared
// between the .c files.
#ifndef ASCQ_KERNELS_H
#define ASCQ_KERNELS_H
#include <stdint.h>

#define ASCQ_API  // called from Python through ctypes

// ---- called from Python --------------------------------------------------------------------------------------

// Bitmask of ASCQ_CPU_* features this CPU has (read at run time, whatever the build's flags).
ASCQ_API int ascq_cpu_features(void);
enum {
    ASCQ_CPU_AVX2 = 1, ASCQ_CPU_FMA = 2, ASCQ_CPU_F16C = 4, ASCQ_CPU_AVX512F = 8, ASCQ_CPU_AVX512BW = 16,
    ASCQ_CPU_AVX512VL = 32, ASCQ_CPU_AVX512BF16 = 64, ASCQ_CPU_AVX512VNNI = 128
};

// weight_only_mm.c: W4A16 / W8A16 products and bf16 dequantization in the tiled layout (native.pack).
// activation_bits: 16, or 8 (4-bit weights only).
ASCQ_API int ascq_weight_only_mm(const void *x, int is_bf16, const uint8_t *w, int bits, int activation_bits,
                                 const void *scales, int scales_bf16, const void *zeros, int zeros_kind, float *y,
                                 int num_rows, int n, int k, int group_size, int num_threads);
// W8A8 / W4A8: activations rounded to int8 as the scheme defines (input_scale <= 0: per token, else per tensor
// with input_zero_point), exact integer products on the same layout.
ASCQ_API int ascq_int8_activation_mm(const void *x, int is_bf16, const uint8_t *w, int bits, const void *scales,
                                     int scales_bf16, const void *zeros, int zeros_kind, float input_scale,
                                     int input_zero_point, float *y, int num_rows, int n, int k, int group_size,
                                     int num_threads);
ASCQ_API int ascq_dequantize_bf16(const uint8_t *w, int bits, const void *scales, int scales_bf16, const void *zeros,
                                  int zeros_kind, uint16_t *out, int n, int k, int group_size, int num_threads);
// bf16_mm.c: x fp32 [M, K] @ w bf16 [N, K]^T for small M.
ASCQ_API int ascq_bf16_mm(const float *x, const uint16_t *w, float *y, int num_rows, int n, int k, int num_threads);
// paged_decode_attention.c: one query token per sequence against a paged KV cache.
ASCQ_API int ascq_paged_decode_attention(const float *query, const void *k_cache, const void *v_cache, int cache_dtype,
                                         int num_cache_blocks, const int32_t *block_tables, int max_blocks,
                                         const int32_t *seq_lens, int num_seqs, int num_heads, int num_kv_heads,
                                         int head_dim, int block_size, float scale, float k_scale, float v_scale,
                                         const float *fp8_values, float *out, int num_threads);
// gptq_columns.c and group_quant_error.c: the converter's GPTQ column loop and MSE observer search.
ASCQ_API int ascq_gptq_columns(float *w, int out, int block_rows, int first, int last, const float *u, int u_stride,
                               float *err, const float *scales, const float *zeros, const int *group_of,
                               int float_zero_point, float q_min, float q_max, int num_threads);
ASCQ_API int ascq_group_quant_errors(const float *x, const float *importance, int num_groups, int group_len,
                                     const float *scales, const float *zeros, int num_candidates, float q_min,
                                     float q_max, float norm, float *errors, int num_threads);
// group_fake_quant.c: min-max round-to-nearest fake quantization of weight groups, and AWQ's clip search on it.
ASCQ_API int ascq_group_fake_quant(const float *x, const float *col_scales, float *out, int rows, int cols,
                                   int group_len, float q_min, float q_max, int symmetric, int scale_kind,
                                   int num_threads);
ASCQ_API int ascq_awq_clip_search(const float *w, int out, int in, int group_len, const float *grams, const float *x,
                                  int num_tokens, const float *shrinks, int num_shrinks, float q_min, float q_max,
                                  int symmetric, int scale_kind, float *best_max, int num_threads);

// torch_cpu_ops.c: a MoE router's softmax + top-k as torch computes them on the CPU (kernels/reference.py
// select_experts) from bf16 logits [num_rows, num_experts]; lanes: torch's fp32 vector width (8 or 16, its sum
// order); top_k <= 17. weights fp32 and ids [num_rows, top_k], in torch.topk's order.
ASCQ_API int ascq_moe_route(const uint16_t *logits, int num_rows, int num_experts, int top_k, int renormalize,
                            int lanes, float *weights, int32_t *ids);

// fused_decode.c: a decoder stack's decode step in one call (Llama layers, DeepSeek-MoE blocks); the model is
// described by these tables.
typedef struct {
    int kind;  // 0: dense bf16 weight [n, k]; 4 or 8: weight-only bits (weight_only_mm.c layout)
    int n, k, group_size, scales_bf16, zeros_kind;
    int a8_min_rows;                      // 4 bits: products of this many rows or more take 8-bit activations (0: never)
    int int8_activations;                 // W8A8 / W4A8: 1, activations rounded as ascq_int8_activation_mm does
    float input_scale;                    // with int8_activations: <= 0 per token, else per tensor
    int input_zero_point;                 // with int8_activations and input_scale > 0
    const void *weight, *scales, *zeros;  // as ascq_weight_only_mm takes them (its tiled layout); zeros may be NULL
    const float *bias;                    // may be NULL
} ascq_fused_linear;

typedef struct {  // a DeepSeek-MoE block: router, softmax top-k, routed experts, plus the shared experts' MLP
    int num_experts, top_k, renormalize, lanes;  // lanes: as ascq_moe_route takes them
    ascq_fused_linear router;                    // [num_experts, hidden]
    const ascq_fused_linear *gate_up, *down;     // [num_experts] each: gate and up merged [2 * inter, hidden]; down
    ascq_fused_linear shared_gate_up, shared_down;  // weight NULL: no shared experts
} ascq_fused_moe;

typedef struct {
    ascq_fused_linear qkv, o, gate_up, down;  // gate_up, down: the dense MLP (unused with moe)
    const ascq_fused_moe *moe;                // NULL: a dense MLP layer
    const uint16_t *input_norm, *post_norm;   // bf16 [hidden]
    uint16_t *k_cache, *v_cache;              // bf16 [num_cache_blocks, block_size, num_kv_heads, head_dim]
} ascq_fused_layer;

typedef struct {
    int num_layers, hidden, num_heads, num_kv_heads, head_dim, block_size, num_cache_blocks;
    float eps, attn_scale;
    const uint16_t *silu_table;  // bf16 silu of every bf16 bit pattern
    const ascq_fused_layer *layers;
    const uint16_t *final_norm;  // bf16 [hidden]: the model's norm after the last layer
} ascq_fused_model;

ASCQ_API int ascq_fused_decode(const ascq_fused_model *m, uint16_t *x, uint16_t *residual, int num_rows,
                               const int64_t *slot_mapping, const int32_t *block_tables, int max_blocks,
                               const int32_t *seq_lens, const uint16_t *cos, const uint16_t *sin, int num_threads);

// ---- shared between the .c files -----------------------------------------------------------------------------

void ascq_quantize_rows(const void *x, int is_bf16, int num_rows, int k, int group_size, int16_t *xq, float *xscale,
                        int32_t *xsum);
void ascq_weight_only_columns(const void *xq, const int32_t *xsum, const float *xscale, const uint8_t *w, int bits,
                              int activation_bits, const void *scales, int scales_bf16, const void *zeros,
                              int zeros_kind, float *y, int num_rows, int n, int k, int group_size, int j0, int j1);
void ascq_quantize_rows_a8(const void *x, int is_bf16, int num_rows, int k, int group_size, int8_t *xq,
                           float *xscale, int32_t *xsum);
void ascq_quantize_rows_int8(const void *x, int is_bf16, int num_rows, int k, int group_size, float input_scale,
                             int input_zero_point, int values_bits, void *xq, float *xscale, int32_t *xsum);
int ascq_weight_only_shapes_ok(int bits, int k, int group_size);
int ascq_weight_only_chunk_columns(int n, int num_threads);
void ascq_bf16_columns(const float *x, const uint16_t *w, float *y, int num_rows, int n, int k, int j0, int j1);
float ascq_torch_sum(const float *x, int n, int squares);
int ascq_moe_route_rows(const uint16_t *logits, int num_rows, int num_experts, int top_k, int renormalize, int lanes,
                        float *scratch, float *weights, int32_t *ids);
int ascq_attention_heads_per_task(int num_seqs, int num_heads, int num_threads);
void ascq_attend_task(int task, int heads_per_task, const float *query, const void *k_cache, const void *v_cache,
                      int dtype, const int32_t *block_tables, int max_blocks, const int32_t *seq_lens, int num_heads,
                      int num_kv_heads, int head_dim, int block_size, float scale, float k_scale, float v_scale,
                      const float *fp8_values, float *scores, float *out);
void ascq_attend_one(const float *query, const void *k_cache, const void *v_cache, int dtype,
                     const int32_t *block_table, int seq_len, int num_kv_heads, int kv_head, int kv_count, int group,
                     int head_dim, int block_size, float scale, float k_scale, float v_scale, const float *fp8_values,
                     float *scores, float *row, float *out);
#endif
