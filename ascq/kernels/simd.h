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

// 8 fp32 lanes -> bf16, rounded to nearest even as torch rounds (NaN -> the canonical quiet NaN).
static inline void store_bf16x8(uint16_t *dst, __m256 v) {
    __m256i bits = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), nan);
    _mm_storeu_si128((__m128i *)dst,
                     _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1)));
}
#endif
