// torch's CPU fp32 ops that the fused decode (fused_decode.c) must reproduce bit for bit, in torch's own order of
// operations: the sum along a row (rms_norm's mean of squares, a router's renormalization), and a MoE router's
// softmax + top-k (kernels/reference.py select_experts). The Python side checks at load that they still agree with
// the running torch (runtime/worker/fused_routing.py), and falls back to eager steps where they do not.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ascq_kernels.h"

// Sum of x[i] (squares: x[i]^2) in the order of torch's CPU sum of a contiguous fp32 row (SumKernel.cpp's
// cascade_sum, the AVX2 kernel torch also runs on AVX-512 hosts). From 8 values: 8-lane vectors, 4 of them side by
// side, cascaded every 16 rows of 4, then the 4 combined, the scalar tail, the 8 lanes in order. Fewer: scalars, 4
// side by side, the tail added to the first, then the other 3.
float ascq_torch_sum(const float *x, int n, int squares) {
    enum { LANES = 8, ILP = 4, LEVELS = 4 };
#define VALUE(i) (squares ? x[i] * x[i] : x[i])
    if (n < LANES) {
        float acc[ILP] = {0.f};
        int i = 0;
        for (; n >= ILP && i < ILP; i++) acc[i] += VALUE(i);
        for (; i < n; i++) acc[0] += VALUE(i);
        for (int k = 1; k < ILP; k++) acc[0] += acc[k];
        return acc[0];
    }
    int num_vecs = n / LANES, num_rows = num_vecs / ILP;
    int ceil_log2 = 0;
    while ((1L << ceil_log2) < num_rows) ceil_log2++;
    int level_power = ceil_log2 / LEVELS > 4 ? ceil_log2 / LEVELS : 4;
    long level_step = 1L << level_power, level_mask = level_step - 1;
    float acc[LEVELS][ILP][LANES] = {{{0}}};
    long i = 0;
#define ADD_ROW(dst, row)                                                                                            \
    for (int k = 0; k < ILP; k++)                                                                                   \
        for (int l = 0; l < LANES; l++) dst[k][l] += VALUE(((row)*ILP + k) * LANES + l);
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
        for (int l = 0; l < LANES; l++) acc[0][0][l] += VALUE(v * LANES + l);
    for (int k = 1; k < ILP; k++)
        for (int l = 0; l < LANES; l++) acc[0][0][l] += acc[0][k][l];
    float total = 0.f;
    for (int t = num_vecs * LANES; t < n; t++) total += VALUE(t);
    for (int l = 0; l < LANES; l++) total += acc[0][0][l];
#undef VALUE
    return total;
}

// ---- softmax ----------------------------------------------------------------------------------------------------

// exp of 8 lanes as Sleef's expf u10 (torch's Vectorized<float>::exp): x = q ln2 + s, a degree-6 polynomial in s,
// times 2^q in two steps; 0 below -104, inf above 100.
static __m256 sleef_expf8(__m256 d) {
    const float r_ln2 = 1.442695040888963407359924681001892137426645954152985934135449406931f;
    const float l2u = 0.693145751953125f, l2l = 1.428606765330187045e-06f;
    __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(d, _mm256_set1_ps(r_ln2)));
    __m256 qf = _mm256_cvtepi32_ps(q);
    __m256 s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-l2u), d);
    s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-l2l), s);
    __m256 u = _mm256_set1_ps(0.000198527617612853646278381f);
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00139304355252534151077271f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00833336077630519866943359f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.0416664853692054748535156f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.166666671633720397949219f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.5f));
    u = _mm256_add_ps(_mm256_set1_ps(1.f), _mm256_fmadd_ps(_mm256_mul_ps(s, s), u, s));
    __m256i half = _mm256_srai_epi32(q, 1), bias = _mm256_set1_epi32(0x7f);
    __m256 first = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
    __m256 second = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(q, half), bias), 23));
    u = _mm256_mul_ps(_mm256_mul_ps(u, first), second);
    u = _mm256_andnot_ps(_mm256_cmp_ps(d, _mm256_set1_ps(-104.f), _CMP_LT_OQ), u);
    return _mm256_blendv_ps(u, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(_mm256_set1_ps(100.f), d, _CMP_LT_OQ));
}

static float add(float a, float b) { return a + b; }

static float maximum(float a, float b) { return isnan(a) || isnan(b) ? NAN : (a > b ? a : b); }

// torch's vec::reduce_all of n values with `lanes`-wide vectors: the vectors combined lane by lane (a partial last
// one into its first lanes), then the lanes in halves (lane i with lane i + lanes/2, ...); fewer than `lanes`
// values: one after another.
static float reduce_all(const float *x, int n, int lanes, float (*op)(float, float)) {
    float acc[16];
    if (n < lanes) {
        acc[0] = x[0];
        for (int i = 1; i < n; i++) acc[0] = op(acc[0], x[i]);
        return acc[0];
    }
    memcpy(acc, x, sizeof(float) * lanes);
    int d = lanes;
    for (; d + lanes <= n; d += lanes)
        for (int l = 0; l < lanes; l++) acc[l] = op(acc[l], x[d + l]);
    for (int l = 0; d + l < n; l++) acc[l] = op(acc[l], x[d + l]);
    for (int half = lanes / 2; half >= 1; half /= 2)
        for (int l = 0; l < half; l++) acc[l] = op(acc[l], acc[l + half]);
    return acc[0];
}

// torch's softmax of one fp32 row (SoftMaxKernel.cpp _vec_softmax_lastdim): exp(x - max), times 1 / their sum.
static void softmax_row(const float *x, int n, int lanes, float *out) {
    float max = reduce_all(x, n, lanes, maximum);
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, sleef_expf8(_mm256_sub_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(max))));
    if (i < n) {
        float tail[8] = {0.f};
        for (int l = 0; i + l < n; l++) tail[l] = x[i + l] - max;
        _mm256_storeu_ps(tail, sleef_expf8(_mm256_loadu_ps(tail)));
        memcpy(out + i, tail, sizeof(float) * (n - i));
    }
    float inverse = 1.f / reduce_all(out, n, lanes, add);
    for (i = 0; i < n; i++) out[i] *= inverse;
}

// ---- top-k: libstdc++'s algorithms as torch.topk runs them (TopKImpl.h), so ties pick the same experts ---------

typedef struct {
    float value;
    int index;
} scored;

static int before(scored a, scored b) {  // torch.topk's comparator for largest=True: NaN first, then larger
    return (isnan(a.value) && !isnan(b.value)) || a.value > b.value;
}

static void swap(scored *a, scored *b) {
    scored t = *a;
    *a = *b, *b = t;
}

static void push_heap(scored *first, long hole, long top, scored value) {
    long parent = (hole - 1) / 2;
    while (hole > top && before(first[parent], value)) {
        first[hole] = first[parent];
        hole = parent;
        parent = (hole - 1) / 2;
    }
    first[hole] = value;
}

static void adjust_heap(scored *first, long hole, long len, scored value) {
    long top = hole, child = hole;
    while (child < (len - 1) / 2) {
        child = 2 * (child + 1);
        if (before(first[child], first[child - 1])) child--;
        first[hole] = first[child];
        hole = child;
    }
    if ((len & 1) == 0 && child == (len - 2) / 2) {
        child = 2 * (child + 1);
        first[hole] = first[child - 1];
        hole = child - 1;
    }
    push_heap(first, hole, top, value);
}

static void pop_heap(scored *first, scored *last, scored *result) {
    scored value = *result;
    *result = *first;
    adjust_heap(first, 0, last - first, value);
}

static void heap_select(scored *first, scored *middle, scored *last) {
    long len = middle - first;
    if (len >= 2)
        for (long parent = (len - 2) / 2;; parent--) {
            adjust_heap(first, parent, len, first[parent]);
            if (parent == 0) break;
        }
    for (scored *i = middle; i < last; i++)
        if (before(*i, *first)) pop_heap(first, middle, i);
}

static void sort_heap(scored *first, scored *last) {
    while (last - first > 1) {
        last--;
        pop_heap(first, last, last);
    }
}

static void move_median_to_first(scored *result, scored *a, scored *b, scored *c) {
    if (before(*a, *b)) {
        if (before(*b, *c))
            swap(result, b);
        else if (before(*a, *c))
            swap(result, c);
        else
            swap(result, a);
    } else if (before(*a, *c))
        swap(result, a);
    else if (before(*b, *c))
        swap(result, c);
    else
        swap(result, b);
}

static scored *unguarded_partition(scored *first, scored *last, scored *pivot) {
    for (;;) {
        while (before(*first, *pivot)) first++;
        last--;
        while (before(*pivot, *last)) last--;
        if (!(first < last)) return first;
        swap(first, last);
        first++;
    }
}

static void insertion_sort(scored *first, scored *last) {  // stable, as libstdc++'s
    for (scored *i = first + 1; i < last; i++) {
        scored value = *i, *hole = i;
        for (; hole > first && before(value, hole[-1]); hole--) *hole = hole[-1];
        *hole = value;
    }
}

static void nth_element(scored *first, scored *nth, scored *last) {  // libstdc++'s introselect
    int depth_limit = 2 * (31 - __builtin_clz((unsigned)(last - first)));
    while (last - first > 3) {
        if (depth_limit == 0) {
            heap_select(first, nth + 1, last);
            swap(first, nth);
            return;
        }
        depth_limit--;
        scored *mid = first + (last - first) / 2;
        move_median_to_first(first, first + 1, mid, last - 1);
        scored *cut = unguarded_partition(first + 1, last, first);
        if (cut <= nth)
            first = cut;
        else
            last = cut;
    }
    insertion_sort(first, last);
}

// torch.topk(k, largest=True, sorted=True) of one row: its values and indices in its order. k <= 17 (std::sort of
// the first k - 1 is then an insertion sort). queue: n entries of scratch.
static void topk_row(const float *x, int n, int k, scored *queue, float *values, int32_t *indices) {
    for (int j = 0; j < n; j++) queue[j] = (scored){x[j], j};
    if ((long)k * 64 <= n) {
        heap_select(queue, queue + k, queue + n);
        sort_heap(queue, queue + k);
    } else {
        nth_element(queue, queue + k - 1, queue + n);
        insertion_sort(queue, queue + k - 1);
    }
    for (int j = 0; j < k; j++) values[j] = queue[j].value, indices[j] = queue[j].index;
}

// select_experts of bf16 router logits [num_rows, num_experts]: softmax in fp32 with torch's `lanes`-wide vectors,
// top_k (<= 17) as torch.topk, weights / their sum when renormalize -> weights fp32 and ids [num_rows, top_k] in
// torch's order. scratch: 4 * num_experts floats. Returns 0, or -1 on bad input.
int ascq_moe_route_rows(const uint16_t *logits, int num_rows, int num_experts, int top_k, int renormalize, int lanes,
                        float *scratch, float *weights, int32_t *ids) {
    if (top_k < 1 || top_k > 17 || top_k > num_experts || (lanes != 8 && lanes != 16)) return -1;
    float *x = scratch, *probs = scratch + num_experts;
    scored *queue = (scored *)(scratch + 2 * num_experts);
    for (int m = 0; m < num_rows; m++) {
        for (int e = 0; e < num_experts; e++) {
            uint32_t bits = (uint32_t)logits[(size_t)m * num_experts + e] << 16;
            memcpy(x + e, &bits, sizeof bits);
        }
        softmax_row(x, num_experts, lanes, probs);
        float *w = weights + (size_t)m * top_k;
        topk_row(probs, num_experts, top_k, queue, w, ids + (size_t)m * top_k);
        if (renormalize) {
            float total = ascq_torch_sum(w, top_k, 0);
            for (int j = 0; j < top_k; j++) w[j] /= total;
        }
    }
    return 0;
}

int ascq_moe_route(const uint16_t *logits, int num_rows, int num_experts, int top_k, int renormalize, int lanes,
                   float *weights, int32_t *ids) {
    float *scratch = malloc(sizeof(float) * 4 * (size_t)num_experts);
    int status = scratch ? ascq_moe_route_rows(logits, num_rows, num_experts, top_k, renormalize, lanes, scratch,
                                               weights, ids)
                         : -1;
    free(scratch);
    return status;
}
