// bf16-weight matmul for small batches on x86 AVX2 (+FMA), compiled on first use by ascq/kernels/native.py.
//
// Why it exists: AVX2 has no bf16 GEMM, so torch runs a bf16 F.linear with M rows as M matrix-vector products (one
// pass over the weights per row): at M = 5 (a speculative verification step, a small decode batch) it costs 5x M = 1.
// Here up to MAX_ROWS activation rows share one pass over each weight row, and every row is reduced in the same order
// whatever M is (two fp32 accumulators per row over alternating runs of 8, then a fixed horizontal sum), so a token's
// result never depends on the rest of the batch: a verification row equals the same token decoded alone.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include "ascq_kernels.h"
#include "simd.h"

#define CHUNK_COLUMNS 256
#ifndef PREFETCH_BYTES  // streams SmolLM2's M = 1 weights faster than 1 KiB did (docs/benchmarks.md)
#define PREFETCH_BYTES 4096
#endif
#define MAX_ROWS 6  // 12 accumulators + 2 weight registers of AVX2's 16: k = 5 proposals verify in one pass

static inline __attribute__((always_inline)) void dot_rows(const uint16_t *w, const float *x, int rows, int k,
                                                           float *out) {
    __m256 even[MAX_ROWS], odd[MAX_ROWS];
    for (int m = 0; m < rows; m++) even[m] = odd[m] = _mm256_setzero_ps();
    for (int i = 0; i < k; i += 16) {
        if (!(i & 31)) _mm_prefetch((const char *)(w + i) + PREFETCH_BYTES, _MM_HINT_T0);
        __m256 w0 = bf16x8_to_f32(w + i), w1 = bf16x8_to_f32(w + i + 8);
        for (int m = 0; m < rows; m++) {
            even[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + (size_t)m * k + i), even[m]);
            odd[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + (size_t)m * k + i + 8), odd[m]);
        }
    }
    for (int m = 0; m < rows; m++) out[m] = hsum8(_mm256_add_ps(even[m], odd[m]));
}

// One row against COLUMNS weight rows at once: the same sums as dot_rows(.., 1, ..) per column, in the same order,
// with 2 * COLUMNS independent FMA chains instead of 2 (one row alone is bound by the FMA latency, not by memory).
#define COLUMNS 4
static inline void dot_columns(const uint16_t *w, const float *x, int k, float *out) {
    __m256 even[COLUMNS], odd[COLUMNS];
    for (int c = 0; c < COLUMNS; c++) even[c] = odd[c] = _mm256_setzero_ps();
    for (int i = 0; i < k; i += 16) {
        __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
        for (int c = 0; c < COLUMNS; c++) {
            const uint16_t *wc = w + (size_t)c * k + i;
            if (!(i & 31)) _mm_prefetch((const char *)wc + PREFETCH_BYTES, _MM_HINT_T0);
            even[c] = _mm256_fmadd_ps(bf16x8_to_f32(wc), x0, even[c]);
            odd[c] = _mm256_fmadd_ps(bf16x8_to_f32(wc + 8), x1, odd[c]);
        }
    }
    for (int c = 0; c < COLUMNS; c++) out[c] = hsum8(_mm256_add_ps(even[c], odd[c]));
}

// Output columns [j0, j1) of y = x @ w.T (each column independent of the split). Also used by fused_decode.c.
void ascq_bf16_columns(const float *x, const uint16_t *w, float *y, int num_rows, int n, int k, int j0, int j1) {
    if (num_rows == 1) {
        for (; j0 + COLUMNS <= j1; j0 += COLUMNS) dot_columns(w + (size_t)j0 * k, x, k, y + j0);
    }
    for (int j = j0; j < j1; j++) {
        const uint16_t *wj = w + (size_t)j * k;
        for (int m0 = 0; m0 < num_rows; m0 += MAX_ROWS) {
            int rows = num_rows - m0 < MAX_ROWS ? num_rows - m0 : MAX_ROWS;
            float out[MAX_ROWS];
            const float *xm = x + (size_t)m0 * k;
            switch (rows) {  // a constant row count inside each inlined copy
            case 1: dot_rows(wj, xm, 1, k, out); break;
            case 2: dot_rows(wj, xm, 2, k, out); break;
            case 3: dot_rows(wj, xm, 3, k, out); break;
            case 4: dot_rows(wj, xm, 4, k, out); break;
            case 5: dot_rows(wj, xm, 5, k, out); break;
            default: dot_rows(wj, xm, 6, k, out); break;
            }
            for (int m = 0; m < rows; m++) y[(size_t)(m0 + m) * n + j] = out[m];
        }
    }
}

// x fp32 [M, K] -> y fp32 [M, N] = x @ w.T, w bf16 (as uint16) [N, K]. Requires K % 16 == 0. Returns 0, or -1.
int ascq_bf16_mm(const float *x, const uint16_t *w, float *y, int num_rows, int n, int k, int num_threads) {
    if (k % 16 || num_rows < 1 || n < 1 || num_threads < 1) return -1;
    // chunks taken by whichever thread is free: a descheduled thread (a shared machine) delays only its chunk
    int num_chunks = (n + CHUNK_COLUMNS - 1) / CHUNK_COLUMNS;
#pragma omp parallel for schedule(dynamic) num_threads(num_threads)
    for (int c = 0; c < num_chunks; c++)
        ascq_bf16_columns(x, w, y, num_rows, n, k, c * CHUNK_COLUMNS,
                          c * CHUNK_COLUMNS + CHUNK_COLUMNS < n ? c * CHUNK_COLUMNS + CHUNK_COLUMNS : n);
    return 0;
}
