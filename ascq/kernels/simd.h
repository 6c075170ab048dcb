// AVX2 pieces shared by ascq's native kernels (included by each .c file; native.py hashes it with the sources).
#ifndef ASCQ_SIMD_H
#define ASCQ_SIMD_H
#include <immintrin.h>
#include <stdint.h>

// 8 bf16 values -> fp32 (exact: a bf16 is the top half of an fp32).
static inline __attribute__((always_inline)) __m256 bf16x8_to_f32(const uint16_t *x) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)x)), 16));
}

// The 8 lanes summed in one fixed order (the two halves, then pairs, then the last two), whatever the data's
// alignment, so a result never depends on which buffer held the inputs.
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif
