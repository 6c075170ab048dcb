/* GPTQ's column loop (ascq/quantize/gptq.py `_solve`) over rows [first, last) of one block of the transposed
 * weight: quantize the row with its group's parameters, keep its scaled error, and subtract the error's share from
 * every later row of the block (a rank-1 update). The same float operations in the same order as the torch loop
 * (ISO C: no contraction into FMAs); it removes that loop's per-column dispatch, not arithmetic. */
#include <math.h>
#include <stddef.h>

int ascq_gptq_columns(float *w, int out, int block_rows, int first, int last, const float *u, int u_stride,
                      float *err, const float *scales, const float *zeros, const int *group_of, int float_zero_point,
                      float q_min, float q_max) {
    if (out < 1 || first < 0 || last > block_rows || first > last || u_stride < block_rows)
        return -1;
    for (int i = first; i < last; i++) {
        float *row = w + (size_t)i * out, *e = err + (size_t)i * out;
        const float *s = scales + (size_t)group_of[i] * out, *z = zeros + (size_t)group_of[i] * out;
        const float *u_row = u + (size_t)i * u_stride;
        float d = u_row[i];
        for (int j = 0; j < out; j++) {
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
            for (int j = 0; j < out; j++)
                target[j] -= c * e[j];
        }
    }
    return 0;
}
