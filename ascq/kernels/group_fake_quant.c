/* Round-to-nearest fake quantization of weight groups with min-max ranges, in one pass per group, and AWQ's clip
 * search built on it: the converter's inner steps of AWQ's scale and clip searches (ascq/quantize/observer.py `fake_quantize_weight` with a minmax
 * observer), where torch runs about a dozen passes with a dispatch each over every candidate's weights.
 *
 * The same IEEE float operations in the same order as qmath.compute_qparams / grid_values / dequantize_into, so
 * the values are torch's bit for bit (tests/test_group_fake_quant.py):
 *   lo = min(min x, 0), hi = max(max x, 0);
 *   asymmetric: s = (hi - lo) / (qmax - qmin), z = round_half_even(clamp(qmin - lo / s, qmin, qmax)) (0 when NaN,
 *     the 0 / 0 of an all-zero group), computed from the unrounded s;
 *   symmetric: s = max(-lo, hi) / ((qmax - qmin) / 2), z = 0;
 *   s rounded to the scale dtype (scale_kind 0 fp32, 1 bf16, 2 fp16), then s = eps of that dtype where it is 0;
 *   out = (round_half_even(clamp(x / s + z, qmin, qmax)) - z) * s, a rounded -0 taken as +0 (torch's values pass
 *   through int8).
 * Groups are split over the threads. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "ascq_kernels.h"
#include "simd.h"

static float round_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if (isnan(f)) return f;
    bits = (bits + 0x7fff + ((bits >> 16) & 1)) & 0xffff0000u;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static float round_fp16(float f) { return _cvtsh_ss(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)); }

static float round_scale(float s, int scale_kind) {
    static const float eps[3] = {1.1920928955078125e-07f, 0.0078125f, 0.0009765625f}; /* torch.finfo(dtype).eps */
    s = scale_kind == 1 ? round_bf16(s) : scale_kind == 2 ? round_fp16(s) : s;
    return s == 0.0f ? eps[scale_kind] : s;
}

static void fake_quant_group(const float *x, float *out, int len, float q_min, float q_max, int symmetric,
                             int scale_kind) {
    float lo = 0.0f, hi = 0.0f; /* the clamps to 0 of compute_qparams folded into the starting values */
    for (int i = 0; i < len; i++) {
        lo = x[i] < lo ? x[i] : lo;
        hi = x[i] > hi ? x[i] : hi;
    }
    float s, z = 0.0f;
    if (symmetric) {
        s = fmaxf(-lo, hi) / ((q_max - q_min) / 2.0f);
    } else {
        s = (hi - lo) / (q_max - q_min);
        float t = q_min - lo / s;
        t = t < q_min ? q_min : (t > q_max ? q_max : t);
        z = isnan(t) ? 0.0f : nearbyintf(t);
    }
    s = round_scale(s, scale_kind);
    __m256 vs = _mm256_set1_ps(s), vz = _mm256_set1_ps(z);
    __m256 lo8 = _mm256_set1_ps(q_min), hi8 = _mm256_set1_ps(q_max);
    int i = 0;
    for (; i + 8 <= len; i += 8) {
        __m256 v = _mm256_add_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), vs), vz);
        v = _mm256_round_ps(_mm256_min_ps(_mm256_max_ps(v, lo8), hi8), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm256_add_ps(v, _mm256_setzero_ps()); /* -0 -> +0, as torch's trip through int8 */
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_sub_ps(v, vz), vs));
    }
    for (; i < len; i++) {
        float v = fminf(fmaxf(x[i] / s + z, q_min), q_max);
        out[i] = (nearbyintf(v) + 0.0f - z) * s;
    }
}

/* x, out: [rows, cols] fp32, groups of group_len along a row (out may be x). col_scales (NULL: none) [cols]: each
 * group is quantized as x * s and the result divided by s again, AWQ's Q(W s) / s of a candidate s (the products and
 * quotients rounded to fp32 as torch's). Returns 0, or -1 on bad arguments. */
int ascq_group_fake_quant(const float *x, const float *col_scales, float *out, int rows, int cols, int group_len,
                          float q_min, float q_max, int symmetric, int scale_kind, int num_threads) {
    if (rows < 0 || group_len < 1 || group_len > 4096 || cols % group_len || num_threads < 1 || scale_kind < 0 ||
        scale_kind > 2 || !(q_min < q_max))
        return -1;
    long num_groups = (long)rows * (cols / group_len);
#pragma omp parallel num_threads(num_threads)
    {
        float scaled[4096];
#pragma omp for schedule(static)
        for (long g = 0; g < num_groups; g++) {
            size_t at = (size_t)g * group_len;
            const float *s = col_scales ? col_scales + at % cols : NULL;
            if (!s) {
                fake_quant_group(x + at, out + at, group_len, q_min, q_max, symmetric, scale_kind);
                continue;
            }
            for (int i = 0; i < group_len; i++) scaled[i] = x[at + i] * s[i];
            fake_quant_group(scaled, out + at, group_len, q_min, q_max, symmetric, scale_kind);
            for (int i = 0; i < group_len; i++) out[at + i] /= s[i];
        }
    }
    return 0;
}

/* d G d^T for a symmetric gram [len, len]: G d^T by FMA rows of G scaled by d_i, 8 columns per vector, up to 64 columns
 * (8 accumulators) per pass. */
static float gram_error(const float *d, int len, const float *gram) {
    float err = 0.0f;
    int t0 = 0;
    for (; t0 + 64 <= len; t0 += 64) {
        __m256 acc[8];
        for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
        for (int i = 0; i < len; i++) {
            __m256 di = _mm256_set1_ps(d[i]);
            const float *row = gram + (size_t)i * len + t0;
            for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(di, _mm256_loadu_ps(row + 8 * j), acc[j]);
        }
        __m256 sum = _mm256_setzero_ps();
        for (int j = 0; j < 8; j++) sum = _mm256_fmadd_ps(acc[j], _mm256_loadu_ps(d + t0 + 8 * j), sum);
        err += hsum8(sum);
    }
    for (int t = t0; t < len; t++) {
        float v = 0.0f;
        for (int i = 0; i < len; i++) v += d[i] * gram[(size_t)i * len + t];
        err += v * d[t];
    }
    return err;
}

/* The partial-output error of a weight change d over one group: with gram (the group's x^T x / n, [len, len]) d G d^T,
 * else the mean over the n tokens x [n, stride] (the group's columns) of (x . d)^2. */
static float change_error(const float *d, int len, const float *gram, const float *x, int num_tokens, int stride) {
    if (gram) return gram_error(d, len, gram);
    float err = 0.0f;
    for (int n = 0; n < num_tokens; n++) {
        const float *row = x + (size_t)n * stride;
        __m256 acc = _mm256_setzero_ps();
        int i = 0;
        for (; i + 8 <= len; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(row + i), _mm256_loadu_ps(d + i), acc);
        float dot = hsum8(acc);
        for (; i < len; i++) dot += row[i] * d[i];
        err += dot * dot;
    }
    return err / (float)num_tokens;
}

/* AWQ's clip search (ascq/quantize/awq.py `search_clip`) for w [out, in] in groups of group_len: for every (row,
 * group) and shrink factor f (in order), the group clipped to +-max|w| * f, fake-quantized as above, and its change's
 * error (change_error: grams [in / group_len, group_len, group_len], or tokens x [num_tokens, in] when grams is NULL);
 * best_max [out, in / group_len] gets the bound of the smallest error (the first on ties). Tasks run group by group,
 * so a group's gram stays in cache across the rows. Returns 0, or -1 on bad arguments. */
int ascq_awq_clip_search(const float *w, int out, int in, int group_len, const float *grams, const float *x,
                         int num_tokens, const float *shrinks, int num_shrinks, float q_min, float q_max, int symmetric,
                         int scale_kind, float *best_max, int num_threads) {
    if (out < 1 || group_len < 1 || in % group_len || num_shrinks < 1 || num_threads < 1 || scale_kind < 0 ||
        scale_kind > 2 || !(q_min < q_max) || group_len > 4096 || (!grams && (!x || num_tokens < 1)))
        return -1;
    int num_groups = in / group_len;
    long num_tasks = (long)num_groups * out;
#pragma omp parallel num_threads(num_threads)
    {
        float clipped[4096], q[4096], d[4096];
#pragma omp for schedule(static)
        for (long task = 0; task < num_tasks; task++) {
            int g = (int)(task / out), r = (int)(task % out);
            const float *wg = w + (size_t)r * in + (size_t)g * group_len;
            const float *gram = grams ? grams + (size_t)g * group_len * group_len : NULL;
            const float *xg = grams ? NULL : x + (size_t)g * group_len;
            float amax = 0.0f;
            for (int i = 0; i < group_len; i++) amax = fmaxf(amax, fabsf(wg[i]));
            float best_err = INFINITY, best = amax;
            for (int step = 0; step < num_shrinks; step++) {
                float bound = amax * shrinks[step];
                __m256 hi = _mm256_set1_ps(bound), lo = _mm256_set1_ps(-bound);
                int i = 0;
                for (; i + 8 <= group_len; i += 8)  /* torch.maximum(torch.minimum(w, b), -b) of finite w */
                    _mm256_storeu_ps(clipped + i, _mm256_max_ps(_mm256_min_ps(_mm256_loadu_ps(wg + i), hi), lo));
                for (; i < group_len; i++) clipped[i] = fmaxf(fminf(wg[i], bound), -bound);
                fake_quant_group(clipped, q, group_len, q_min, q_max, symmetric, scale_kind);
                for (i = 0; i < group_len; i++) d[i] = q[i] - wg[i];
                float err = change_error(d, group_len, gram, xg, num_tokens, in);
                if (err < best_err) best_err = err, best = bound;
            }
            best_max[(size_t)r * num_groups + g] = best;
        }
    }
    return 0;
}
