/* The MSE weight observer's inner loop (ascq/quantize/qmath.py `weight_ranges`): for every group of weights and
 * every candidate (scale, zero point) of that group, the quantization error sum |dequantize(quantize(x)) - x|^norm.
 * quantize/dequantize are qmath's float steps (x / s + z, clamp, round half to even, (q - z) * s: exact IEEE
 * operations, the same values as torch); |d|^norm is exp2(norm * log2 |d|) from the polynomials below (relative
 * error about 1e-6, where torch's pow is within an ulp), and the sum runs in 8 lanes: an error can differ from
 * torch's in its last bits, so only candidates that tie to that precision may be picked differently. One pass over
 * a group per candidate, in registers, instead of torch's ten passes with a dispatch each. Groups are split over the
 * threads. */
#include <float.h>
#include <stddef.h>

#include "ascq_kernels.h"
#include "simd.h"

/* log2(x) for normal x > 0: x = m 2^e with m in [sqrt(1/2), sqrt(2)), log2 m = 2/ln2 atanh(t), t = (m-1)/(m+1),
 * by its series to t^9 (|t| < 0.172: truncation below 2e-9). */
static inline __m256 log2_ps(__m256 x) {
    __m256i bits = _mm256_castps_si256(x);
    __m256i exponent = _mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(127));
    __m256 m = _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi32(0x007fffff)),
                                                   _mm256_set1_epi32(0x3f800000)));
    __m256 big = _mm256_cmp_ps(m, _mm256_set1_ps(1.41421356f), _CMP_GT_OQ);
    m = _mm256_blendv_ps(m, _mm256_mul_ps(m, _mm256_set1_ps(0.5f)), big);
    __m256 e = _mm256_add_ps(_mm256_cvtepi32_ps(exponent), _mm256_and_ps(big, _mm256_set1_ps(1.0f)));
    __m256 one = _mm256_set1_ps(1.0f);
    __m256 t = _mm256_div_ps(_mm256_sub_ps(m, one), _mm256_add_ps(m, one));
    __m256 t2 = _mm256_mul_ps(t, t);
    __m256 p = _mm256_set1_ps(1.0f / 9);
    p = _mm256_fmadd_ps(p, t2, _mm256_set1_ps(1.0f / 7));
    p = _mm256_fmadd_ps(p, t2, _mm256_set1_ps(1.0f / 5));
    p = _mm256_fmadd_ps(p, t2, _mm256_set1_ps(1.0f / 3));
    p = _mm256_fmadd_ps(p, t2, one);
    return _mm256_fmadd_ps(_mm256_mul_ps(p, t), _mm256_set1_ps(2.88539008f), e); /* 2 / ln 2 */
}

/* 2^y for y in [-126, 127]: 2^n by the exponent bits (n = round(y)) times 2^f, f in [-1/2, 1/2], by the Taylor
 * series of e^(f ln 2) to degree 7 (truncation below 6e-9). */
static inline __m256 exp2_ps(__m256 y) {
    __m256 n = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_mul_ps(_mm256_sub_ps(y, n), _mm256_set1_ps(0.693147181f));
    __m256 p = _mm256_set1_ps(1.0f / 5040);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 720));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

/* |d|^norm, 0 where |d| is below the smallest normal float or the power underflows */
static inline __m256 abs_pow(__m256 d, __m256 norm) {
    __m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), d);
    __m256 normal = _mm256_cmp_ps(a, _mm256_set1_ps(FLT_MIN), _CMP_GE_OQ);
    __m256 y = _mm256_mul_ps(norm, log2_ps(_mm256_max_ps(a, _mm256_set1_ps(FLT_MIN))));
    __m256 in_range = _mm256_cmp_ps(y, _mm256_set1_ps(-126.0f), _CMP_GE_OQ);
    y = _mm256_min_ps(_mm256_max_ps(y, _mm256_set1_ps(-126.0f)), _mm256_set1_ps(127.0f));
    return _mm256_and_ps(exp2_ps(y), _mm256_and_ps(normal, in_range));
}

static float group_error(const float *x, const float *importance, int group_len, float s, float z, float q_min,
                         float q_max, __m256 norm) {
    __m256 vs = _mm256_set1_ps(s), vz = _mm256_set1_ps(z);
    __m256 lo = _mm256_set1_ps(q_min), hi = _mm256_set1_ps(q_max);
    __m256 acc = _mm256_setzero_ps();
    for (int j = 0; j < group_len; j += 8) {
        __m256 v, weight = _mm256_set1_ps(1.0f);
        if (j + 8 <= group_len) {
            v = _mm256_loadu_ps(x + j);
            if (importance)
                weight = _mm256_loadu_ps(importance + j);
        } else { /* the ragged tail: missing lanes read as 0, and their error is masked out below */
            __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(group_len - j), lane);
            v = _mm256_maskload_ps(x + j, mask);
            if (importance)
                weight = _mm256_maskload_ps(importance + j, mask);
        }
        __m256 q = _mm256_add_ps(_mm256_div_ps(v, vs), vz);
        q = _mm256_min_ps(_mm256_max_ps(q, lo), hi);
        q = _mm256_round_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m256 d = _mm256_sub_ps(_mm256_mul_ps(_mm256_sub_ps(q, vz), vs), v);
        if (j + 8 > group_len) {
            __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            d = _mm256_and_ps(d, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(group_len - j), lane)));
        }
        __m256 e = abs_pow(d, norm);
        acc = _mm256_add_ps(acc, importance ? _mm256_mul_ps(e, weight) : e);
    }
    return hsum8(acc);
}

/* x and importance (NULL: all 1) [num_groups, group_len]; scales, zeros (NULL: symmetric) and errors
 * [num_groups, num_candidates]; with importance, each element's error is multiplied by its weight */
int ascq_group_quant_errors(const float *x, const float *importance, int num_groups, int group_len,
                            const float *scales, const float *zeros, int num_candidates, float q_min, float q_max,
                            float norm, float *errors, int num_threads) {
    if (num_groups < 0 || group_len < 1 || num_candidates < 1 || num_threads < 1 || !(norm > 0.0f))
        return -1;
    __m256 vnorm = _mm256_set1_ps(norm);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int g = 0; g < num_groups; g++) {
        const float *row = x + (size_t)g * group_len;
        const float *weights = importance ? importance + (size_t)g * group_len : NULL;
        for (int c = 0; c < num_candidates; c++) {
            size_t k = (size_t)g * num_candidates + c;
            errors[k] = group_error(row, weights, group_len, scales[k], zeros ? zeros[k] : 0.0f, q_min, q_max, vnorm);
        }
    }
    return 0;
}
