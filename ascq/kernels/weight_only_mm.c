// W4A16 / W8A16 matmul for small batches on x86 AVX2 (+FMA), compiled on first use by ascq/kernels/native.py.
//
// Why it exists: torch's _weight_int4pack_mm_for_cpu / _weight_int8pack_mm convert every weight to fp32 and are
// compute-bound on AVX2 (~6.7 G int4 weights/s per thread, measured), far from the memory bound. Here each activation
// row is turned into 16-bit fixed point (per-row scale = max|x| / 32767, 15 bits against bf16's 8), so 16 weights
// cost one _mm256_madd_epi16.
//
// Weight layouts (see native.py): 4 bits: uint8 [N, K/2]; in each run of 32 weights of a row, byte j holds weight j
// (low nibble) and weight j+16 (high nibble) as unsigned u = q + 8, dequantized (u - zu[n,g]) * s[n,g] with
// zu = zero point + 8. 8 bits: int8 [N, K] as is, dequantized (q - z[n,g]) * s[n,g]. Integer partial sums are exact:
// |sum| <= group_size * max|q| * 32767 < 2^31 for the group sizes native.py allows (4096 at 4 bits, 2048 at 8).
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_ROWS 4  // activation rows sharing one pass over the weights

int ascq_cpu_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

static float bf16_to_float(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

// One activation row -> int16 values, its scale, and per-group sums of the int16 values.
static void quantize_row(const void *x, int is_bf16, int k, int group_size, int16_t *xq, float *xscale,
                         int32_t *xsum) {
    float amax = 0.f;
    for (int i = 0; i < k; i++) {
        float v = is_bf16 ? bf16_to_float(((const uint16_t *)x)[i]) : ((const float *)x)[i];
        amax = fmaxf(amax, fabsf(v));
    }
    float scale = amax > 0.f ? amax / 32767.f : 1.f;
    float inv = 1.f / scale;
    for (int g = 0; g < k / group_size; g++) xsum[g] = 0;
    for (int i = 0; i < k; i++) {
        float v = is_bf16 ? bf16_to_float(((const uint16_t *)x)[i]) : ((const float *)x)[i];
        long q = lrintf(v * inv);
        q = q > 32767 ? 32767 : (q < -32767 ? -32767 : q);
        xq[i] = (int16_t)q;
        xsum[i / group_size] += (int32_t)q;
    }
    *xscale = scale;
}

// Sixteen-bit weights [32] of run i (weight index i .. i+31 of the row) as two vectors of 16.
static inline __attribute__((always_inline)) void load_run(const uint8_t *w, int i, int bits, __m256i *first,
                                                          __m256i *second) {
    if (bits == 4) {  // one widening per 32 weights: 16-bit lanes hold a whole byte, then split its nibbles
        __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(w + i / 2)));
        *first = _mm256_and_si256(bytes, _mm256_set1_epi16(0x0f));
        *second = _mm256_srli_epi16(bytes, 4);
    } else {
        *first = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + i)));
        *second = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + i + 16)));
    }
}

// y[m, n] for rows m < num_rows of one block of activation rows, one output feature n. Always inlined with constant
// num_rows and bits, so the per-row accumulators live in registers. scales, zeros (zu): this feature's, as fp32.
static inline __attribute__((always_inline)) void dot_row(const uint8_t *w, const int16_t *xq, const int32_t *xsum,
                                                         const float *xscale, const float *scales, const float *zeros,
                                                         int num_rows, int bits, int k, int group_size, float *out) {
    int num_groups = k / group_size;
    __m256 total[MAX_ROWS];
    float offset[MAX_ROWS];  // sum over groups of s * zu * sum(x), subtracted once at the end
    for (int m = 0; m < num_rows; m++) {
        total[m] = _mm256_setzero_ps();
        offset[m] = 0.f;
        for (int g = 0; g < num_groups; g++)
            offset[m] += scales[g] * zeros[g] * (float)xsum[(size_t)m * num_groups + g];
    }
    for (int g = 0; g < num_groups; g++) {
        __m256i acc[MAX_ROWS];
        for (int m = 0; m < num_rows; m++) acc[m] = _mm256_setzero_si256();
        for (int i = g * group_size; i < (g + 1) * group_size; i += 32) {
            __m256i w_first, w_second;
            load_run(w, i, bits, &w_first, &w_second);
            for (int m = 0; m < num_rows; m++) {
                const int16_t *xrow = xq + (size_t)m * k + i;
                __m256i x_first = _mm256_loadu_si256((const __m256i *)xrow);
                __m256i x_second = _mm256_loadu_si256((const __m256i *)(xrow + 16));
                acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(w_first, x_first));
                acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(w_second, x_second));
            }
        }
        __m256 scale = _mm256_set1_ps(scales[g]);
        for (int m = 0; m < num_rows; m++) total[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m]), scale, total[m]);
    }
    for (int m = 0; m < num_rows; m++) {
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(total[m]), _mm256_extractf128_ps(total[m], 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        s = _mm_add_ss(s, _mm_movehdup_ps(s));
        out[m] = (_mm_cvtss_f32(s) - offset[m]) * xscale[m];
    }
}

// One activation row against COLS consecutive output features: the same arithmetic per feature as dot_row with one
// row (each result bit-identical), with COLS independent accumulator chains instead of one, so a decode step's
// single row is not bound by the latency of one fmadd chain per group. w: the first feature's weights, w_stride
// bytes apart; scales, zeros [COLS][num_groups].
#define COLS 4
#define PREFETCH_BLOCKS 4
static inline __attribute__((always_inline)) void dot_cols(const uint8_t *w, size_t w_stride, const int16_t *xq,
                                                          const int32_t *xsum, float xscale, const float *scales,
                                                          const float *zeros, int bits, int k, int group_size,
                                                          float *out) {
    int num_groups = k / group_size;
    __m256 total[COLS];
    float offset[COLS];
    for (int c = 0; c < COLS; c++) {
        total[c] = _mm256_setzero_ps();
        offset[c] = 0.f;
    }
    for (int g = 0; g < num_groups; g++)
        for (int c = 0; c < COLS; c++)
            offset[c] += scales[c * num_groups + g] * zeros[c * num_groups + g] * (float)xsum[g];
    for (int g = 0; g < num_groups; g++) {
        __m256i acc[COLS];
        for (int c = 0; c < COLS; c++) acc[c] = _mm256_setzero_si256();
        for (int i = g * group_size; i < (g + 1) * group_size; i += 32) {
            // the block PREFETCH_BLOCKS ahead, one 32-weight run's share per run (a block's weights are contiguous:
            // COLS * 4 * bits bytes per run), so the weights stream from memory instead of stalling each load
            const char *ahead = (const char *)w + PREFETCH_BLOCKS * COLS * w_stride + (size_t)(i / 32) * COLS * 4 * bits;
            for (int line = 0; line < COLS * 4 * bits; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
            __m256i x_first = _mm256_loadu_si256((const __m256i *)(xq + i));
            __m256i x_second = _mm256_loadu_si256((const __m256i *)(xq + i + 16));
            for (int c = 0; c < COLS; c++) {
                __m256i w_first, w_second;
                load_run(w + c * w_stride, i, bits, &w_first, &w_second);
                acc[c] = _mm256_add_epi32(acc[c], _mm256_madd_epi16(w_first, x_first));
                acc[c] = _mm256_add_epi32(acc[c], _mm256_madd_epi16(w_second, x_second));
            }
        }
        for (int c = 0; c < COLS; c++)
            total[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[c]), _mm256_set1_ps(scales[c * num_groups + g]),
                                       total[c]);
    }
    for (int c = 0; c < COLS; c++) {
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(total[c]), _mm256_extractf128_ps(total[c], 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        s = _mm_add_ss(s, _mm_movehdup_ps(s));
        out[c] = (_mm_cvtss_f32(s) - offset[c]) * xscale;
    }
}

// Feature j's scales and zu (zero point + 8 at 4 bits; the default where zeros is NULL) as fp32 [num_groups].
// Stored scales: fp32, or bf16 (scales_bf16); zeros: fp32 zu, or int8 zero points (zeros_int8).
static void load_qparams(const void *scales, int scales_bf16, const void *zeros, int zeros_int8, int bits, size_t j,
                         int num_groups, float *s, float *zu) {
    size_t at = j * num_groups;
    for (int g = 0; g < num_groups; g++) {
        s[g] = scales_bf16 ? bf16_to_float(((const uint16_t *)scales)[at + g]) : ((const float *)scales)[at + g];
        if (!zeros)
            zu[g] = bits == 4 ? 8.f : 0.f;
        else if (zeros_int8)
            zu[g] = (float)(((const int8_t *)zeros)[at + g] + (bits == 4 ? 8 : 0));
        else
            zu[g] = ((const float *)zeros)[at + g];
    }
}

#define DOT_ROW(rows, bits) dot_row(wj, xm, sm, xscale + m0, sj, zj, rows, bits, k, group_size, out)

// Activation rows x [M, K] (fp32, or bf16 when is_bf16) -> xq int16 [M, K], xscale [M], xsum int32 [M, K/group_size].
void ascq_quantize_rows(const void *x, int is_bf16, int num_rows, int k, int group_size, int16_t *xq, float *xscale,
                        int32_t *xsum) {
    size_t row_bytes = is_bf16 ? 2 : 4;
    for (int m = 0; m < num_rows; m++)
        quantize_row((const char *)x + m * row_bytes * k, is_bf16, k, group_size, xq + (size_t)m * k, xscale + m,
                     xsum + (size_t)m * (k / group_size));
}

// Output columns [j0, j1) of y [M, N] from rows quantized by ascq_quantize_rows (each column independent of the
// others and of how columns are split across threads). Also used by fused_decode.c.
void ascq_weight_only_columns(const int16_t *xq, const int32_t *xsum, const float *xscale, const uint8_t *w, int bits,
                              const void *scales, int scales_bf16, const void *zeros, int zeros_int8, float *y,
                              int num_rows, int n, int k, int group_size, int j0, int j1) {
    int num_groups = k / group_size;
    size_t w_stride = (size_t)k * bits / 8;
    float *sj = malloc(sizeof(float) * 2 * COLS * num_groups), *zj = sj + COLS * num_groups;
    if (!sj) return;  // unreachable in practice (a few KB); the caller's output stays unwritten
    int j = j0;
    if (num_rows == 1) {
        for (; j + COLS <= j1; j += COLS) {
            float out[COLS];
            for (int c = 0; c < COLS; c++)
                load_qparams(scales, scales_bf16, zeros, zeros_int8, bits, j + c, num_groups, sj + c * num_groups,
                             zj + c * num_groups);
            if (bits == 4)
                dot_cols(w + j * w_stride, w_stride, xq, xsum, xscale[0], sj, zj, 4, k, group_size, out);
            else
                dot_cols(w + j * w_stride, w_stride, xq, xsum, xscale[0], sj, zj, 8, k, group_size, out);
            for (int c = 0; c < COLS; c++) y[j + c] = out[c];
        }
    }
    for (; j < j1; j++) {
        load_qparams(scales, scales_bf16, zeros, zeros_int8, bits, j, num_groups, sj, zj);
        const uint8_t *wj = w + j * w_stride;
        for (int m0 = 0; m0 < num_rows; m0 += MAX_ROWS) {
            int rows = num_rows - m0 < MAX_ROWS ? num_rows - m0 : MAX_ROWS;
            float out[MAX_ROWS];
            const int16_t *xm = xq + (size_t)m0 * k;
            const int32_t *sm = xsum + (size_t)m0 * num_groups;
            switch (rows * 16 + bits) {  // constant rows and bits inside each inlined copy
            case 16 + 4: DOT_ROW(1, 4); break;
            case 32 + 4: DOT_ROW(2, 4); break;
            case 48 + 4: DOT_ROW(3, 4); break;
            case 64 + 4: DOT_ROW(4, 4); break;
            case 16 + 8: DOT_ROW(1, 8); break;
            case 32 + 8: DOT_ROW(2, 8); break;
            case 48 + 8: DOT_ROW(3, 8); break;
            default: DOT_ROW(4, 8); break;
            }
            for (int m = 0; m < rows; m++) y[(size_t)(m0 + m) * n + j] = out[m];
        }
    }
    free(sj);
}

// Whether ascq_weight_only_mm accepts these shapes.
int ascq_weight_only_shapes_ok(int bits, int k, int group_size) {
    int max_group = bits == 4 ? 4096 : 2048;
    return (bits == 4 || bits == 8) && !(k % 32) && !(group_size % 32) && group_size > 0 && !(k % group_size) &&
           group_size <= max_group;
}

// x [M, K] (fp32, or bf16 when is_bf16) -> y [M, N] fp32. w: `bits` (4 or 8) weights in the layout above;
// scales [N, K/group_size] fp32 or bf16 (scales_bf16), zeros the same shape, fp32 zu (zero point + 8 at 4 bits) or
// int8 zero points (zeros_int8), NULL: symmetric. num_threads: torch.get_num_threads() of the caller.
// Requires K % 32 == 0, group_size % 32 == 0, K % group_size == 0, group_size <= 4096 (2048 at 8 bits).
// Returns 0, or -1 on bad input.
int ascq_weight_only_mm(const void *x, int is_bf16, const uint8_t *w, int bits, const void *scales, int scales_bf16,
                        const void *zeros, int zeros_int8, float *y, int num_rows, int n, int k, int group_size,
                        int num_threads) {
    if (!ascq_weight_only_shapes_ok(bits, k, group_size) || num_rows < 1 || num_threads < 1) return -1;
    int num_groups = k / group_size;
    int16_t *xq = malloc(sizeof(int16_t) * (size_t)num_rows * k);
    int32_t *xsum = malloc(sizeof(int32_t) * (size_t)num_rows * num_groups);
    float *xscale = malloc(sizeof(float) * (size_t)num_rows);
    if (!xq || !xsum || !xscale) {
        free(xq), free(xsum), free(xscale);
        return -1;
    }
    ascq_quantize_rows(x, is_bf16, num_rows, k, group_size, xq, xscale, xsum);
#pragma omp parallel num_threads(num_threads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        ascq_weight_only_columns(xq, xsum, xscale, w, bits, scales, scales_bf16, zeros, zeros_int8, y, num_rows, n,
                                 k, group_size, (int)((long)n * t / nt), (int)((long)n * (t + 1) / nt));
    }
    free(xq), free(xsum), free(xscale);
    return 0;
}
