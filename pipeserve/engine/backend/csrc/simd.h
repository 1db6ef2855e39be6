// One register of fp32 lanes of the build's vector ISA (AVX-512: 16 lanes; AVX2 with FMA: 8), and
// the few operations the kernels written once for both need (included, not compiled on its own).
// PIPESERVE_SIMD is defined where the build has either.
#pragma once

#include <cfloat>
#include <cstdint>

#include "vec_math.h"

#if defined(PIPESERVE_AVX512) || defined(PIPESERVE_AVX2)
#define PIPESERVE_SIMD 1

namespace pipeserve::simd {

#if defined(PIPESERVE_AVX512)
constexpr int kWidth = 16;
constexpr int kAccumulators = 16;  // registers a kernel may keep accumulators in (of 32)
using vec = __m512;

inline vec zero() { return _mm512_setzero_ps(); }
inline vec set1(float x) { return _mm512_set1_ps(x); }
inline vec load(const float* p) { return _mm512_loadu_ps(p); }
inline vec load(const uint16_t* bf16) { return load_bf16x16(bf16); }
inline void store(float* p, vec x) { _mm512_storeu_ps(p, x); }
inline vec mul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec fmadd(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
// The first n lanes (n in [1, kWidth]): stored, or their maximum.
inline void store_first(float* p, vec x, int n) { _mm512_mask_storeu_ps(p, lanes(n), x); }
inline float max_first(vec x, int n) { return _mm512_mask_reduce_max_ps(lanes(n), x); }

// Lane j = the sum of v[j]'s lanes: kWidth dot products finished by one transpose-and-add tree (15
// adds, 30 shuffles) instead of kWidth horizontal reductions, whose dependent shuffle chains bound
// the loop that produces them.
inline vec sum_pairs(vec a, vec b) {  // per 128-bit lane: a0+a2, b0+b2, a1+a3, b1+b3
  return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}
inline vec sum_quads(vec a, vec b) {  // per 128-bit lane: the 4 vectors' partial sums
  const __m512d x = _mm512_castps_pd(a), y = _mm512_castps_pd(b);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
}
inline vec sum_lanes(vec a, vec b) {  // adjacent 128-bit lanes added: a's two pairs, then b's
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
}
inline vec sum_each(const vec* v) {
  vec w[4];
  for (int i = 0; i < 4; ++i)
    w[i] = sum_quads(sum_pairs(v[4 * i], v[4 * i + 1]), sum_pairs(v[4 * i + 2], v[4 * i + 3]));
  return sum_lanes(sum_lanes(w[0], w[1]), sum_lanes(w[2], w[3]));
}
#else
constexpr int kWidth = 8;
constexpr int kAccumulators = 12;  // of 16 registers: the rest hold a row's values and a weight
using vec = __m256;

inline vec zero() { return _mm256_setzero_ps(); }
inline vec set1(float x) { return _mm256_set1_ps(x); }
inline vec load(const float* p) { return _mm256_loadu_ps(p); }
inline vec load(const uint16_t* bf16) {  // widened: bf16 is fp32's top half, so no rounding
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bf16));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline void store(float* p, vec x) { _mm256_storeu_ps(p, x); }
inline vec mul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec fmadd(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline __m256i first(int n) { return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)); }
inline void store_first(float* p, vec x, int n) { _mm256_maskstore_ps(p, first(n), x); }
inline float max_first(vec x, int n) {
  x = _mm256_blendv_ps(_mm256_set1_ps(-FLT_MAX), x, _mm256_castsi256_ps(first(n)));
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// Lane j = the sum of v[j]'s lanes, by one transpose-and-add tree (6 horizontal adds, 2 permutes).
inline vec sum_each(const vec* v) {
  // hadd(a, b) per 128-bit lane: a0+a1, a2+a3, b0+b1, b2+b3. Twice: each vector's lower four lanes'
  // sum in the low half, its upper four's in the high half (v0-v3 in ab, v4-v7 in cd).
  const vec ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const vec cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}
#endif

}  // namespace pipeserve::simd
#endif
