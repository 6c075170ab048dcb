// W4A16 / W8A16 matmul for small batches on x86 AVX2 (+FMA), compiled on first use by ascq/kernels/native.py.
//
// Why it exists: torch's _weight_int4pack_mm_for_cpu / _weight_int8pack_mm convert every weight to fp32 and are
// compute-bound on AVX2 (~6.7 G int4 weights/s per thread, measured), far from the memory bound. Here each activation
// row is turned into 16-bit fixed point (per-row scale = max|x| / 32767, 15 bits against bf16's 8), so 16 weights
// cost one _mm256_madd_epi16.
//
// Weight layout (native.py `pack`): output features in tiles of TILE = 8 (zero weights pad the last tile). A tile's
// weights for all K inputs are contiguous, in quads of 4 inputs: at 4 bits a quad is 16 bytes, byte 2j + p holding
// feature j's u[4q + p] (low nibble) and u[4q + 2 + p] (high nibble), u = q + 8; at 8 bits a quad is 32 bytes, byte
// 2j + p of the first 16 holding q[4q + p] and of the second 16 q[4q + 2 + p]. Widened to 16-bit lanes, a quad is
// two vectors of each feature's input pairs side by side, so one _mm256_madd_epi16 against a broadcast activation
// pair gives the tile's 8 partial sums in 8 int32 lanes: no horizontal sums, and each group's scales and zero points
// are one vector load. Qparams [tiles, groups, 8]: scales fp32 or bf16; zero points int8, bf16 or fp32 (or none:
// symmetric); w = (u - zu) * s, zu = zero point + 8 at 4 bits. Integer partial sums are exact within a group:
// |sum| <= group_size * max|u| * 32767 < 2^31 for the group sizes native.py allows (4096 at 4 bits, 2048 at 8).
// Each output is sum over groups, in order, of (acc - zu * sum(x)) * s, then times the row's scale: the same
// arithmetic for a row whatever the other rows, the column split or the thread count.
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ascq_kernels.h"
#include "simd.h"

#define TILE 8
#define MAX_ROWS 4        // activation rows sharing one pass over a tile's weights
#define CHUNKS_PER_THREAD 2
#define PREFETCH_BYTES 4096  // SmolLM2's M = 1 linears streamed from DRAM: 4096 and 8192 beat 1024 and 2048

enum { ZEROS_NONE = 0, ZEROS_INT8 = 1, ZEROS_BF16 = 2, ZEROS_FP32 = 3 };

int ascq_cpu_features(void) {
    __builtin_cpu_init();
    return (__builtin_cpu_supports("avx2") ? ASCQ_CPU_AVX2 : 0) | (__builtin_cpu_supports("fma") ? ASCQ_CPU_FMA : 0) |
           (__builtin_cpu_supports("f16c") ? ASCQ_CPU_F16C : 0) |
           (__builtin_cpu_supports("avx512f") ? ASCQ_CPU_AVX512F : 0) |
           (__builtin_cpu_supports("avx512bw") ? ASCQ_CPU_AVX512BW : 0) |
           (__builtin_cpu_supports("avx512vl") ? ASCQ_CPU_AVX512VL : 0) |
           (__builtin_cpu_supports("avx512bf16") ? ASCQ_CPU_AVX512BF16 : 0) |
           (__builtin_cpu_supports("avx512vnni") ? ASCQ_CPU_AVX512VNNI : 0);
}

static inline __m256 load8_row(const void *x, int is_bf16, int i) {
    return is_bf16 ? bf16x8_to_f32((const uint16_t *)x + i) : _mm256_loadu_ps((const float *)x + i);
}

// One activation row -> int16 values, its scale, and per-group sums of the int16 values. Values round to nearest
// even (the default MXCSR mode, as lrintf) and clamp to +-32767; k % 32 == 0.
static void quantize_row(const void *x, int is_bf16, int k, int group_size, int16_t *xq, float *xscale,
                         int32_t *xsum) {
    __m256 amax8 = _mm256_setzero_ps(), abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int i = 0; i < k; i += 8)  // NaN inputs are skipped, as fmaxf does: max_ps returns its second operand
        amax8 = _mm256_max_ps(_mm256_and_ps(load8_row(x, is_bf16, i), abs_mask), amax8);
    float lanes[8], amax = 0.f;
    _mm256_storeu_ps(lanes, amax8);
    for (int l = 0; l < 8; l++) amax = fmaxf(amax, lanes[l]);
    float scale = amax > 0.f ? amax / 32767.f : 1.f;
    __m256 inv = _mm256_set1_ps(1.f / scale);
    __m256i low = _mm256_set1_epi32(-32767), high = _mm256_set1_epi32(32767);
    for (int g = 0; g < k / group_size; g++) {
        __m256i sum = _mm256_setzero_si256();
        for (int i = g * group_size; i < (g + 1) * group_size; i += 16) {
            __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(load8_row(x, is_bf16, i), inv));
            __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(load8_row(x, is_bf16, i + 8), inv));
            a = _mm256_min_epi32(_mm256_max_epi32(a, low), high);
            b = _mm256_min_epi32(_mm256_max_epi32(b, low), high);
            sum = _mm256_add_epi32(sum, _mm256_add_epi32(a, b));
            _mm256_storeu_si256((__m256i *)(xq + i), _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xd8));
        }
        int32_t parts[8], total = 0;
        _mm256_storeu_si256((__m256i *)parts, sum);
        for (int l = 0; l < 8; l++) total += parts[l];
        xsum[g] = total;
    }
    *xscale = scale;
}

static inline __m256 load8_scales(const void *scales, int scales_bf16, size_t at) {
    return scales_bf16 ? bf16x8_to_f32((const uint16_t *)scales + at) : _mm256_loadu_ps((const float *)scales + at);
}

static inline __m256 load8_zu(const void *zeros, int zeros_kind, size_t at, __m256 bias) {
    switch (zeros_kind) {
    case ZEROS_INT8: {
        __m128i bytes = _mm_loadl_epi64((const __m128i *)((const int8_t *)zeros + at));
        return _mm256_add_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), bias);
    }
    case ZEROS_BF16: return _mm256_add_ps(bf16x8_to_f32((const uint16_t *)zeros + at), bias);
    case ZEROS_FP32: return _mm256_add_ps(_mm256_loadu_ps((const float *)zeros + at), bias);
    default: return bias;
    }
}

// A quad of the layout widened to 16-bit lanes: lane 2j + p of `first` is feature j's input 4q + p, of `second` its
// input 4q + 2 + p (at 4 bits the unsigned u = q + 8, at 8 bits q).
static inline __attribute__((always_inline)) void unpack_quad(const uint8_t *quad, int bits, __m256i *first,
                                                              __m256i *second) {
    if (bits == 4) {
        __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)quad));
        *first = _mm256_and_si256(bytes, _mm256_set1_epi16(0x0f));
        *second = _mm256_srli_epi16(bytes, 4);
    } else {
        *first = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)quad));
        *second = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(quad + 16)));
    }
}

// Tile t's scales and zero points (NULL when symmetric) in the [tiles, groups, 8] qparam layout.
static inline void tile_qparams(const void *scales, int scales_bf16, const void *zeros, int zeros_kind,
                                int num_groups, size_t t, const void **tile_scales, const void **tile_zeros) {
    size_t tile_qparams = (size_t)num_groups * TILE, scale_size = scales_bf16 ? 2 : 4;
    size_t zero_size = zeros_kind == ZEROS_INT8 ? 1 : (zeros_kind == ZEROS_BF16 ? 2 : 4);
    *tile_scales = (const char *)scales + t * tile_qparams * scale_size;
    *tile_zeros = zeros ? (const char *)zeros + t * tile_qparams * zero_size : NULL;
}

// Whether a zero-point kind and pointer agree (ZEROS_NONE exactly when zeros is NULL).
static int zeros_ok(const void *zeros, int zeros_kind) {
    return zeros_kind >= ZEROS_NONE && zeros_kind <= ZEROS_FP32 && (zeros_kind == ZEROS_NONE) == (zeros == NULL);
}

static inline __m256i broadcast_pair(const int16_t *x) {
    int32_t pair;
    memcpy(&pair, x, sizeof pair);
    return _mm256_set1_epi32(pair);
}

// One tile (8 output features) against `rows` activation rows: out[r] = the 8 outputs of row r. Always inlined with
// constant rows and bits, so the accumulators live in registers. w: the tile's weights; scales, zeros: the tile's.
static inline __attribute__((always_inline)) void tile_rows(const uint8_t *w, const void *scales, int scales_bf16,
                                                           const void *zeros, int zeros_kind, int bits,
                                                           const int16_t *xq, const int32_t *xsum,
                                                           const float *xscale, int rows, int k, int group_size,
                                                           __m256 *out) {
    int num_groups = k / group_size, quad_bytes = 4 * bits;
    __m256 bias = _mm256_set1_ps(bits == 4 ? 8.f : 0.f);
    __m256 total[MAX_ROWS];
    for (int r = 0; r < rows; r++) total[r] = _mm256_setzero_ps();
    const uint8_t *wq = w;
    for (int g = 0; g < num_groups; g++) {
        __m256i acc[MAX_ROWS], acc_second[MAX_ROWS];  // two chains per row: integer sums, exact in any order
        for (int r = 0; r < rows; r++) acc[r] = acc_second[r] = _mm256_setzero_si256();
        // a cache line per iteration (4 quads at 4 bits, 2 at 8; a group spans whole lines), one prefetch each
        for (int i = g * group_size; i < (g + 1) * group_size; i += 64 / bits, wq += 64) {
            _mm_prefetch((const char *)wq + PREFETCH_BYTES, _MM_HINT_T0);
            for (int u = 0; u < 64 / quad_bytes; u++) {
                __m256i first, second;
                unpack_quad(wq + u * quad_bytes, bits, &first, &second);
                for (int r = 0; r < rows; r++) {
                    const int16_t *x = xq + (size_t)r * k + i + 4 * u;
                    acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(first, broadcast_pair(x)));
                    acc_second[r] = _mm256_add_epi32(acc_second[r], _mm256_madd_epi16(second, broadcast_pair(x + 2)));
                }
            }
        }
        for (int r = 0; r < rows; r++) acc[r] = _mm256_add_epi32(acc[r], acc_second[r]);
        __m256 s = load8_scales(scales, scales_bf16, (size_t)g * TILE);
        __m256 zu = load8_zu(zeros, zeros_kind, (size_t)g * TILE, bias);
        for (int r = 0; r < rows; r++) {
            __m256 sum_x = _mm256_set1_ps((float)xsum[(size_t)r * num_groups + g]);
            __m256 t = _mm256_fnmadd_ps(zu, sum_x, _mm256_cvtepi32_ps(acc[r]));
            total[r] = _mm256_fmadd_ps(t, s, total[r]);
        }
    }
    for (int r = 0; r < rows; r++) out[r] = _mm256_mul_ps(total[r], _mm256_set1_ps(xscale[r]));
}

#define TILE_ROWS(rows, bits)                                                                                        \
    tile_rows(wt, st, scales_bf16, zt, zeros_kind, bits, xq16 + (size_t)m0 * k, xsum + (size_t)m0 * num_groups,      \
              xscale + m0, rows, k, group_size, out)

// ---- 4-bit weights against 8-bit activations (products of several rows) -------------------------------------
// AVX2 has no wider integer multiply than _mm256_madd_epi16 (16 products), and on Zen 2 it issues on one port: the
// 16-bit tile_rows above runs at that port's limit (74 GFLOP/s per thread, docs/benchmarks.md). _mm256_maddubs_epi16
// multiplies 32 unsigned x signed byte pairs on the same port, so with activations in 8 bits (per row and group:
// scale = max|x| / 127, values in [-127, 127]) and the offset-binary nibbles u in [0, 15] a tile costs half the
// multiplies. The layout needs no change: masked, the low nibbles of a quad are each feature's first input pair in
// one 16-bit lane per feature, the high nibbles its second pair. A pair sum is at most 2 * 15 * 127 = 3810, so
// spans of inputs add exactly in 16 bits before they are widened (tile_rows_a8). vLLM's CPU AWQ / GPTQ path (IPEX,
// WoqLowpMode.INT8) also quantizes activations per input block to int8.
#define A8_SPAN 32  // inputs per 16-bit accumulation

// One row's 8-bit values, per-group scales and per-group sums of the values (group_size % 32 == 0).
static void quantize_row_a8(const void *x, int is_bf16, int k, int group_size, int8_t *xq, float *xscale,
                            int32_t *xsum) {
    __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256i low = _mm256_set1_epi32(-127), high = _mm256_set1_epi32(127);
    for (int g = 0; g < k / group_size; g++) {
        int first = g * group_size;
        __m256 amax8 = _mm256_setzero_ps();
        for (int i = first; i < first + group_size; i += 8)
            amax8 = _mm256_max_ps(_mm256_and_ps(load8_row(x, is_bf16, i), abs_mask), amax8);
        float lanes[8], amax = 0.f;
        _mm256_storeu_ps(lanes, amax8);
        for (int l = 0; l < 8; l++) amax = fmaxf(amax, lanes[l]);
        float scale = amax > 0.f ? amax / 127.f : 1.f;
        __m256 inv = _mm256_set1_ps(1.f / scale);
        __m256i sum = _mm256_setzero_si256();
        for (int i = first; i < first + group_size; i += 32) {
            __m256i v[4];
            for (int h = 0; h < 4; h++) {
                v[h] = _mm256_cvtps_epi32(_mm256_mul_ps(load8_row(x, is_bf16, i + 8 * h), inv));
                v[h] = _mm256_min_epi32(_mm256_max_epi32(v[h], low), high);
                sum = _mm256_add_epi32(sum, v[h]);
            }
            // packs interleave 128-bit lanes: 32-bit lane order 0, 4, 1, 5, 2, 6, 3, 7 restores the input order
            __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
            bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)(xq + i), bytes);
        }
        int32_t parts[8], total = 0;
        _mm256_storeu_si256((__m256i *)parts, sum);
        for (int l = 0; l < 8; l++) total += parts[l];
        xsum[g] = total;
        xscale[g] = scale;
    }
}

// Activation rows x [M, K] -> xq int8 [M, K], xscale fp32 [M, K / group_size], xsum int32 [M, K / group_size]. Also
// used by fused_decode.c.
void ascq_quantize_rows_a8(const void *x, int is_bf16, int num_rows, int k, int group_size, int8_t *xq,
                           float *xscale, int32_t *xsum) {
    size_t row_bytes = is_bf16 ? 2 : 4, num_groups = k / group_size;
    for (int m = 0; m < num_rows; m++)
        quantize_row_a8((const char *)x + m * row_bytes * k, is_bf16, k, group_size, xq + (size_t)m * k,
                        xscale + m * num_groups, xsum + m * num_groups);
}

static inline __m256i broadcast_four(const int8_t *x) {
    int32_t four;
    memcpy(&four, x, sizeof four);
    return _mm256_set1_epi32(four);
}

// One tile (8 output features, 4-bit) against `rows` 8-bit activation rows: out[r] = the 8 outputs of row r.
// A 32-byte load holds quads q and q + 1. Their masked low and high nibbles interleaved in 16-bit units put each
// feature's 4 inputs of a quad in 4 adjacent bytes; the 128-bit halves regrouped by quad give one vector per quad
// (features 0-3 | features 4-7) against its 4 activations broadcast, and _mm256_madd_epi16 with ones sums each
// feature's two 16-bit lanes into one 32-bit lane. Two quads add at most 4 * 3810 = 15240 per 16-bit lane, so
// every 32 inputs (4 such steps, 30480) are widened.
static inline __attribute__((always_inline)) void tile_rows_a8(const uint8_t *w, const void *scales,
                                                              int scales_bf16, const void *zeros, int zeros_kind,
                                                              const int8_t *xq, const int32_t *xsum,
                                                              const float *xscale, int rows, int k, int group_size,
                                                              __m256 *out) {
    int num_groups = k / group_size;
    __m256i nibble = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    __m256 bias = _mm256_set1_ps(8.f);
    __m256 total[MAX_ROWS];
    for (int r = 0; r < rows; r++) total[r] = _mm256_setzero_ps();
    const uint8_t *wq = w;
    for (int g = 0; g < num_groups; g++) {
        __m256i acc[MAX_ROWS];
        for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_si256();
        for (int i0 = g * group_size; i0 < (g + 1) * group_size; i0 += A8_SPAN) {
            __m256i part[MAX_ROWS];
            for (int r = 0; r < rows; r++) part[r] = _mm256_setzero_si256();
#pragma GCC unroll 1  // unrolled, GCC hoists the multiplies of all four steps and spills their results
            for (int i = i0; i < i0 + A8_SPAN; i += 8, wq += 32) {
                __m256i bytes = _mm256_loadu_si256((const __m256i *)wq);
                __m256i low = _mm256_and_si256(bytes, nibble);
                __m256i high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
                __m256i features_low = _mm256_unpacklo_epi16(low, high), features_high = _mm256_unpackhi_epi16(low, high);
                __m256i quad0 = _mm256_permute2x128_si256(features_low, features_high, 0x20);
                __m256i quad1 = _mm256_permute2x128_si256(features_low, features_high, 0x31);
                for (int r = 0; r < rows; r++) {
                    const int8_t *x = xq + (size_t)r * k + i;
                    __m256i sum = _mm256_add_epi16(_mm256_maddubs_epi16(quad0, broadcast_four(x)),
                                                   _mm256_maddubs_epi16(quad1, broadcast_four(x + 4)));
                    part[r] = _mm256_add_epi16(part[r], sum);
                }
            }
            for (int r = 0; r < rows; r++) acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(part[r], ones));
        }
        __m256 s = load8_scales(scales, scales_bf16, (size_t)g * TILE);
        __m256 zu = load8_zu(zeros, zeros_kind, (size_t)g * TILE, bias);
        for (int r = 0; r < rows; r++) {
            __m256 sum_x = _mm256_set1_ps((float)xsum[(size_t)r * num_groups + g]);
            __m256 t = _mm256_fnmadd_ps(zu, sum_x, _mm256_cvtepi32_ps(acc[r]));
            __m256 scale = _mm256_mul_ps(s, _mm256_set1_ps(xscale[(size_t)r * num_groups + g]));
            total[r] = _mm256_fmadd_ps(t, scale, total[r]);
        }
    }
    for (int r = 0; r < rows; r++) out[r] = total[r];
}

#define TILE_ROWS_A8(rows)                                                                                           \
    tile_rows_a8(wt, st, scales_bf16, zt, zeros_kind, xq8 + (size_t)m0 * k, xsum + (size_t)m0 * num_groups,         \
                 xscale + (size_t)m0 * num_groups, rows, k, group_size, out)

// ---- the products, with either activation width ------------------------------------------------------------------

// Activation rows x [M, K] (fp32, or bf16 when is_bf16) -> xq int16 [M, K], xscale [M], xsum int32 [M, K/group_size].
void ascq_quantize_rows(const void *x, int is_bf16, int num_rows, int k, int group_size, int16_t *xq, float *xscale,
                        int32_t *xsum) {
    size_t row_bytes = is_bf16 ? 2 : 4;
    for (int m = 0; m < num_rows; m++)
        quantize_row((const char *)x + m * row_bytes * k, is_bf16, k, group_size, xq + (size_t)m * k, xscale + m,
                     xsum + (size_t)m * (k / group_size));
}

// Output columns [j0, j1) of y [M, N] (j0 a multiple of TILE) from rows quantized by ascq_quantize_rows
// (activation_bits 16: xq int16, xscale per row) or, for 4-bit weights, ascq_quantize_rows_a8 (activation_bits 8: xq
// int8, xscale per row and group). Also used by fused_decode.c.
void ascq_weight_only_columns(const void *xq, const int32_t *xsum, const float *xscale, const uint8_t *w, int bits,
                              int activation_bits, const void *scales, int scales_bf16, const void *zeros,
                              int zeros_kind, float *y, int num_rows, int n, int k, int group_size, int j0, int j1) {
    int num_groups = k / group_size;
    size_t tile_bytes = (size_t)k * bits;
    const int16_t *xq16 = xq;
    const int8_t *xq8 = xq;
    for (int j = j0; j < j1; j += TILE) {
        size_t t = (size_t)j / TILE;
        const uint8_t *wt = w + t * tile_bytes;
        const void *st, *zt;
        tile_qparams(scales, scales_bf16, zeros, zeros_kind, num_groups, t, &st, &zt);
        int width = j1 - j < TILE ? j1 - j : TILE;
        for (int m0 = 0; m0 < num_rows; m0 += MAX_ROWS) {
            int rows = num_rows - m0 < MAX_ROWS ? num_rows - m0 : MAX_ROWS;
            __m256 out[MAX_ROWS];
            // constant rows and bits inside each inlined copy
            switch (activation_bits == 8 ? rows : rows * 16 + bits) {
            case 1: TILE_ROWS_A8(1); break;
            case 2: TILE_ROWS_A8(2); break;
            case 3: TILE_ROWS_A8(3); break;
            case 4: TILE_ROWS_A8(4); break;
            case 16 + 4: TILE_ROWS(1, 4); break;
            case 32 + 4: TILE_ROWS(2, 4); break;
            case 48 + 4: TILE_ROWS(3, 4); break;
            case 64 + 4: TILE_ROWS(4, 4); break;
            case 16 + 8: TILE_ROWS(1, 8); break;
            case 32 + 8: TILE_ROWS(2, 8); break;
            case 48 + 8: TILE_ROWS(3, 8); break;
            default: TILE_ROWS(4, 8); break;
            }
            for (int r = 0; r < rows; r++) {
                float *dst = y + (size_t)(m0 + r) * n + j;
                if (width == TILE) {
                    _mm256_storeu_ps(dst, out[r]);
                } else {
                    float values[TILE];
                    _mm256_storeu_ps(values, out[r]);
                    memcpy(dst, values, sizeof(float) * width);
                }
            }
        }
    }
}

// ---- integer activations as W8A8 / W4A8 checkpoints define them --------------------------------------------
// Per token (dynamic: scale = max|x| / 127 in fp32, a zero row scale 0) or per tensor (static: the checkpoint's
// input scale and zero point), q = clamp(round_half_even(x / scale) + zero point, -128, 127) by an IEEE division
// as qmath.quantize_per_token / quantize_static_input compute it (the same bits), and v = q - zero point the
// integer each weight multiplies. 8-bit weights take v as int16 (|v| <= 255) through tile_rows (exact int32 sums
// of |v * w| <= 255 * 128 per product), 4-bit weights as int8 (symmetric only) through tile_rows_a8 with the row's
// scale repeated per group. The products are exact integer sums; only the scales are applied in float.
static void quantize_row_int8(const void *x, int is_bf16, int k, int group_size, float input_scale,
                              int input_zero_point, int values_bits, void *xq, float *xscale, int32_t *xsum) {
    float scale = input_scale;
    if (input_scale <= 0.f) {  // dynamic: the row's max |x| / 127
        __m256 amax8 = _mm256_setzero_ps(), abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
        for (int i = 0; i < k; i += 8)
            amax8 = _mm256_max_ps(_mm256_and_ps(load8_row(x, is_bf16, i), abs_mask), amax8);
        float lanes[8], amax = 0.f;
        _mm256_storeu_ps(lanes, amax8);
        for (int l = 0; l < 8; l++) amax = fmaxf(amax, lanes[l]);
        scale = amax / 127.f;
    }
    __m256 divisor = _mm256_set1_ps(scale > 0.f ? scale : 1.f), zero = _mm256_set1_ps((float)input_zero_point);
    __m256 low = _mm256_set1_ps(-128.f), high = _mm256_set1_ps(127.f);
    int num_groups = k / group_size;
    for (int g = 0; g < num_groups; g++) {
        __m256i sum = _mm256_setzero_si256();
        for (int i = g * group_size; i < (g + 1) * group_size; i += 32) {
            __m256i v[4];
            for (int h = 0; h < 4; h++) {
                __m256 q = _mm256_round_ps(_mm256_div_ps(load8_row(x, is_bf16, i + 8 * h), divisor),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                q = _mm256_min_ps(_mm256_max_ps(_mm256_add_ps(q, zero), low), high);
                v[h] = _mm256_cvtps_epi32(_mm256_sub_ps(q, zero));
                sum = _mm256_add_epi32(sum, v[h]);
            }
            if (values_bits == 16) {
                for (int h = 0; h < 4; h += 2)
                    _mm256_storeu_si256((__m256i *)((int16_t *)xq + i + 8 * h),
                                        _mm256_permute4x64_epi64(_mm256_packs_epi32(v[h], v[h + 1]), 0xd8));
            } else {  // as quantize_row_a8 packs them
                __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
                bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
                _mm256_storeu_si256((__m256i *)((int8_t *)xq + i), bytes);
            }
        }
        int32_t parts[8], total = 0;
        _mm256_storeu_si256((__m256i *)parts, sum);
        for (int l = 0; l < 8; l++) total += parts[l];
        xsum[g] = total;
        if (values_bits == 8) xscale[g] = scale;
    }
    if (values_bits == 16) *xscale = scale;
}

// Activation rows x [M, K] -> integer values (int16 where values_bits is 16, else int8) [M, K], xscale (per row, or
// per row and group at 8) and xsum int32 [M, K / group_size]. input_scale <= 0: per token. Also used by
// fused_decode.c.
void ascq_quantize_rows_int8(const void *x, int is_bf16, int num_rows, int k, int group_size, float input_scale,
                             int input_zero_point, int values_bits, void *xq, float *xscale, int32_t *xsum) {
    size_t row_bytes = is_bf16 ? 2 : 4, num_groups = k / group_size, value_bytes = values_bits / 8;
    for (int m = 0; m < num_rows; m++)
        quantize_row_int8((const char *)x + m * row_bytes * k, is_bf16, k, group_size, input_scale,
                          input_zero_point, values_bits, (char *)xq + m * value_bytes * k,
                          xscale + m * (values_bits == 8 ? num_groups : 1), xsum + m * num_groups);
}

// Columns per chunk of an n-column product (whole tiles): CHUNKS_PER_THREAD chunks per thread. A chunk's weights
// are one contiguous run, and at M = 1 the weights come from DRAM (a decode step streams more than the L3 holds),
// where long runs matter: two chunks per thread with a 4 KiB prefetch beat 8-tile chunks with 1 KiB clearly on
// SmolLM2's linears at M = 1 (docs/benchmarks.md).
int ascq_weight_only_chunk_columns(int n, int num_threads) {
    int num_tiles = (n + TILE - 1) / TILE, num_chunks = CHUNKS_PER_THREAD * num_threads;
    return (num_tiles + num_chunks - 1) / num_chunks * TILE;
}

// Whether ascq_weight_only_mm accepts these shapes.
int ascq_weight_only_shapes_ok(int bits, int k, int group_size) {
    int max_group = bits == 4 ? 4096 : 2048;
    return (bits == 4 || bits == 8) && !(k % 32) && !(group_size % 32) && group_size > 0 && !(k % group_size) &&
           group_size <= max_group;
}

// Every column of y [M, N] from quantized rows (xq, xsum, xscale as ascq_weight_only_columns takes them), in chunks
// taken by whichever thread is free: a descheduled thread (a shared machine) delays only its chunk.
static void all_columns(const void *xq, const int32_t *xsum, const float *xscale, const uint8_t *w, int bits,
                        int activation_bits, const void *scales, int scales_bf16, const void *zeros, int zeros_kind,
                        float *y, int num_rows, int n, int k, int group_size, int num_threads) {
    int chunk_columns = ascq_weight_only_chunk_columns(n, num_threads);
    int num_chunks = (n + chunk_columns - 1) / chunk_columns;
#pragma omp parallel for schedule(dynamic) num_threads(num_threads)
    for (int c = 0; c < num_chunks; c++) {
        int j0 = c * chunk_columns, j1 = j0 + chunk_columns < n ? j0 + chunk_columns : n;
        ascq_weight_only_columns(xq, xsum, xscale, w, bits, activation_bits, scales, scales_bf16, zeros, zeros_kind,
                                 y, num_rows, n, k, group_size, j0, j1);
    }
}

typedef struct {  // a product's quantized activation rows
    void *xq;
    int32_t *xsum;
    float *xscale;
} quantized_rows;

static int alloc_rows(quantized_rows *r, int num_rows, int k, int group_size, int value_bytes, int scales_per_group) {
    size_t num_groups = k / group_size;
    r->xq = malloc((size_t)num_rows * k * value_bytes);
    r->xsum = malloc(sizeof(int32_t) * num_rows * num_groups);
    r->xscale = malloc(sizeof(float) * num_rows * (scales_per_group ? num_groups : 1));
    if (r->xq && r->xsum && r->xscale) return 0;
    free(r->xq), free(r->xsum), free(r->xscale);
    return -1;
}

static void free_rows(quantized_rows *r) { free(r->xq), free(r->xsum), free(r->xscale); }

// x [M, K] (fp32, or bf16 when is_bf16) -> y [M, N] fp32. w, scales, zeros: the tiled layout above (zeros NULL:
// symmetric; zeros_kind says their type). activation_bits: 16, or 8 for 4-bit weights (see the section above).
// num_threads: torch.get_num_threads() of the caller.
// Requires K % 32 == 0, group_size % 32 == 0, K % group_size == 0, group_size <= 4096 (2048 at 8 bits).
// Returns 0, or -1 on bad input.
int ascq_weight_only_mm(const void *x, int is_bf16, const uint8_t *w, int bits, int activation_bits,
                        const void *scales, int scales_bf16, const void *zeros, int zeros_kind, float *y, int num_rows,
                        int n, int k, int group_size, int num_threads) {
    int a8 = activation_bits == 8;
    quantized_rows r;
    if (!ascq_weight_only_shapes_ok(bits, k, group_size) || num_rows < 1 || n < 1 || num_threads < 1 ||
        !zeros_ok(zeros, zeros_kind) || !(activation_bits == 16 || (a8 && bits == 4)) ||
        alloc_rows(&r, num_rows, k, group_size, a8 ? 1 : 2, a8))
        return -1;
    if (a8)
        ascq_quantize_rows_a8(x, is_bf16, num_rows, k, group_size, r.xq, r.xscale, r.xsum);
    else
        ascq_quantize_rows(x, is_bf16, num_rows, k, group_size, r.xq, r.xscale, r.xsum);
    all_columns(r.xq, r.xsum, r.xscale, w, bits, activation_bits, scales, scales_bf16, zeros, zeros_kind, y, num_rows,
                n, k, group_size, num_threads);
    free_rows(&r);
    return 0;
}

// W8A8 / W4A8: x [M, K] rounded to integers as the checkpoint's scheme defines (the section above: input_scale <= 0
// per token, else per tensor with input_zero_point; 4-bit weights only symmetric), times the weights in the tiled
// layout -> y [M, N] fp32 = the exact integer product times the weight and activation scales. Same shape
// requirements as ascq_weight_only_mm. Returns 0, or -1 on bad input.
int ascq_int8_activation_mm(const void *x, int is_bf16, const uint8_t *w, int bits, const void *scales,
                            int scales_bf16, const void *zeros, int zeros_kind, float input_scale,
                            int input_zero_point, float *y, int num_rows, int n, int k, int group_size,
                            int num_threads) {
    int values_bits = bits == 4 ? 8 : 16;
    quantized_rows r;
    if (!ascq_weight_only_shapes_ok(bits, k, group_size) || num_rows < 1 || n < 1 || num_threads < 1 ||
        !zeros_ok(zeros, zeros_kind) || input_zero_point < -128 || input_zero_point > 127 ||
        (bits == 4 && input_zero_point != 0) || alloc_rows(&r, num_rows, k, group_size, values_bits / 8, bits == 4))
        return -1;
    ascq_quantize_rows_int8(x, is_bf16, num_rows, k, group_size, input_scale, input_zero_point, values_bits, r.xq,
                            r.xscale, r.xsum);
    all_columns(r.xq, r.xsum, r.xscale, w, bits, values_bits == 8 ? 8 : 16, scales, scales_bf16, zeros, zeros_kind, y,
                num_rows, n, k, group_size, num_threads);
    free_rows(&r);
    return 0;
}

// The dequantized weight (q - zero) * s of the tiled layout, rounded to bf16, into out [n, k] (row-major): for a bf16
// GEMM on hosts where that is fast (AMX). Same requirements as ascq_weight_only_mm; returns 0, or -1 on bad input.
int ascq_dequantize_bf16(const uint8_t *w, int bits, const void *scales, int scales_bf16, const void *zeros,
                         int zeros_kind, uint16_t *out, int n, int k, int group_size, int num_threads) {
    if (!ascq_weight_only_shapes_ok(bits, k, group_size) || n < 1 || num_threads < 1 || !zeros_ok(zeros, zeros_kind))
        return -1;
    int num_groups = k / group_size, num_tiles = (n + TILE - 1) / TILE, quad_bytes = 4 * bits;
    __m256i low_features = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
    __m256i high_features = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int t = 0; t < num_tiles; t++) {
        const uint8_t *wq = w + (size_t)t * k * bits;
        const void *st, *zt;
        tile_qparams(scales, scales_bf16, zeros, zeros_kind, num_groups, (size_t)t, &st, &zt);
        int width = n - t * TILE < TILE ? n - t * TILE : TILE;
        __m256i offset = _mm256_set1_epi16(bits == 4 ? 8 : 0);  // q = u - 8 first, then q - zero: torch's order
        for (int g = 0; g < num_groups; g++) {
            __m256 s = load8_scales(st, scales_bf16, (size_t)g * TILE);
            __m256 zu = load8_zu(zt, zeros_kind, (size_t)g * TILE, _mm256_setzero_ps());
            __m256 s_low = _mm256_permutevar8x32_ps(s, low_features);
            __m256 s_high = _mm256_permutevar8x32_ps(s, high_features);
            __m256 zu_low = _mm256_permutevar8x32_ps(zu, low_features);
            __m256 zu_high = _mm256_permutevar8x32_ps(zu, high_features);
            for (int i = g * group_size; i < (g + 1) * group_size; i += 4, wq += quad_bytes) {
                __m256i first, second;
                unpack_quad(wq, bits, &first, &second);
                uint32_t pairs[2][TILE];  // [first / second][feature]: two bf16 values each
                __m256i halves[2] = {_mm256_sub_epi16(first, offset), _mm256_sub_epi16(second, offset)};
                for (int h = 0; h < 2; h++) {
                    __m256 low = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(halves[h])));
                    __m256 high = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(halves[h], 1)));
                    store_bf16x8((uint16_t *)pairs[h], _mm256_mul_ps(_mm256_sub_ps(low, zu_low), s_low));
                    store_bf16x8((uint16_t *)pairs[h] + 8, _mm256_mul_ps(_mm256_sub_ps(high, zu_high), s_high));
                }
                for (int j = 0; j < width; j++) {
                    uint64_t four = pairs[0][j] | (uint64_t)pairs[1][j] << 32;
                    memcpy(out + ((size_t)t * TILE + j) * k + i, &four, sizeof four);
                }
            }
        }
    }
    return 0;
}
