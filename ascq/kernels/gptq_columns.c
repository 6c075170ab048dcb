/* GPTQ's column loop (ascq/quantize/gptq.py `_solve`) over rows [first, last) of one block of the transposed
 * weight: quantize the row with its group's parameters, keep its scaled error, and subtract the error's share from
 * every later row of the block (a rank-1 update). The same float operations in the same order as the torch loop
 * (ISO C: no contraction into FMAs); it removes that loop's per-column dispatch, not arithmetic. Each output
 * column j (an element of every row) is updated independently of the others, so the threads split j into
 * contiguous ranges and never meet. */
#include <math.h>
#include <stddef.h>

#include "ascq_kernels.h"

static void columns(float *w, int out, int block_rows, int first, int last, const float *u, int u_stride, float *err,
                    const float *scales, const float *zeros, const int *group_of, int float_zero_point, float q_min,
                    float q_max, int j_begin, int j_end) {
    for (int i = first; i < last; i++) {
        float *row = w + (size_t)i * out, *e = err + (size_t)i * out;
        const float *s = scales + (size_t)group_of[i] * out, *z = zeros + (size_t)group_of[i] * out;
        const float *u_row = u + (size_t)i * u_stride;
        float d = u_row[i];
        for (int j = j_begin; j < j_end; j++) {
            float q = row[j] / s[j];
            q = float_zero_point ? nearbyintf(q + z[j]) : nearbyintf(q) + z[j];
            q = fminf(fmaxf(q, q_min), q_max);
            q = (q - z[j]) * s[j];
            e[j] = (row[j] - q) / d;
            row[j] = q;
        }
        for (int k = i + 1; k < block_rows; k++) {
            float c = u_row[k];
            float *target = w + (size_t)k * out;
            for (int j = j_begin; j < j_end; j++)
                target[j] -= c * e[j];
        }
    }
}

int ascq_gptq_columns(float *w, int out, int block_rows, int first, int last, const float *u, int u_stride,
                      float *err, const float *scales, const float *zeros, const int *group_of, int float_zero_point,
                      float q_min, float q_max, int num_threads) {
    if (out < 1 || first < 0 || last > block_rows || first > last || u_stride < block_rows || num_threads < 1)
        return -1;
    int num_chunks = out < 64 * num_threads ? 1 : num_threads;  /* a chunk of at least 64 columns per thread */
#pragma omp parallel for num_threads(num_chunks) schedule(static, 1)
    for (int c = 0; c < num_chunks; c++) {
        int j_begin = (int)((long)out * c / num_chunks) & ~15;  /* 16-float aligned ranges */
        int j_end = c + 1 == num_chunks ? out : (int)((long)out * (c + 1) / num_chunks) & ~15;
        columns(w, out, block_rows, first, last, u, u_stride, err, scales, zeros, group_of, float_zero_point, q_min,
                q_max, j_begin, j_end);
    }
    return 0;
}
