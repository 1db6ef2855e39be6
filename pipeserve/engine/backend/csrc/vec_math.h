// Vectorizable float math shared by the native kernels (included, not compiled on its own).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
// AVX-512 with the word and 256-bit forms (BW, VL: every AVX-512 CPU since Skylake-SP), which the bf16
// loads and stores below and the kernels built on them need.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PIPESERVE_AVX512 1
#include <immintrin.h>
#endif
// AVX2 with FMA (x86-64-v3: every x86 server CPU since Haswell and Zen) and no AVX-512: kernels of
// 256-bit registers.
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define PIPESERVE_AVX2 1
#include <immintrin.h>
#endif

namespace pipeserve {

// e^x for x <= 0 (softmax terms, sigmoids): Cephes' expf, a degree-6 polynomial around the nearest
// power of two, within 2 ulp. Unlike std::exp it vectorizes in simd loops.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// bf16 <-> fp32 (bf16 weights, caches and the activations a bf16 product rounds).
inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Round to nearest even, as torch's float -> bfloat16 conversion (NaN kept a quiet NaN).
inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

#if defined(PIPESERVE_AVX512)
// 16 bf16 values (the first `mask` lanes) widened to fp32: bf16 is fp32's top half, so no rounding.
inline __m512 load_bf16x16(const uint16_t* p, __mmask16 mask = 0xFFFF) {
  const __m256i h = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// float_to_bf16 of 16 lanes, kept in fp32 (the low 16 bits zero): the same rounding bit for bit,
// denormals and NaN included (AVX512-BF16's conversion treats denormal inputs as zero).
inline __m512 round_bf16x16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i top = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), odd), top);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q),
                            _mm512_or_si512(_mm512_and_si512(bits, top), _mm512_set1_epi32(0x400000)));
  return _mm512_castsi512_ps(r);
}

// float_to_bf16 of 16 lanes (the first `mask` stored).
inline void store_bf16x16(uint16_t* p, __m512 x, __mmask16 mask = 0xFFFF) {
  const __m512i r = _mm512_srli_epi32(_mm512_castps_si512(round_bf16x16(x)), 16);
  _mm256_mask_storeu_epi16(p, mask, _mm512_cvtepi32_epi16(r));
}

// The first n lanes, as a mask (n in [0, 16]).
inline __mmask16 lanes(int64_t n) { return static_cast<__mmask16>(n >= 16 ? 0xFFFF : (1u << n) - 1u); }

// exp_nonpositive of 16 lanes, the same steps.
inline __m512 exp_nonpositive16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// silu of 16 lanes, the same steps.
inline __m512 silu16(__m512 g) {
  const __m512 e = exp_nonpositive16(_mm512_castsi512_ps(
      _mm512_or_si512(_mm512_castps_si512(g), _mm512_set1_epi32(static_cast<int>(0x80000000u)))));
  const __mmask16 positive = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_GE_OQ);
  const __m512 num = _mm512_mask_blend_ps(positive, e, _mm512_set1_ps(1.0f));
  return _mm512_mul_ps(g, _mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
}
#endif

// out = x / rms(x) * w over n channels (x and out may alias), as HF: the scale, then the weight.
inline void rms_norm(const float* x, const float* __restrict w, float eps, float* out, int64_t n) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv * w[i];
}

// Rotate-half rotary embedding of `heads` heads of head_dim at x (in place), at one position:
// table row [rot_dim] holds cos in its first half and sin in its second.
inline void rope(float* x, int heads, int head_dim, const float* row, int rot_dim) {
  const int half = rot_dim / 2;
  const float* cos = row;
  const float* sin = row + half;
  for (int h = 0; h < heads; ++h) {
    float* __restrict a = x + static_cast<int64_t>(h) * head_dim;
    float* __restrict b = a + half;
#pragma omp simd
    for (int i = 0; i < half; ++i) {
      const float x1 = a[i], x2 = b[i];
      a[i] = x1 * cos[i] - x2 * sin[i];
      b[i] = x2 * cos[i] + x1 * sin[i];
    }
  }
}

// silu(g) = g * sigmoid(g), with the exponential of -|g| only (no overflow either side).
inline float silu(float g) {
  const float e = exp_nonpositive(-std::fabs(g));
  return g * (g >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e));
}

// out = silu(gate) * up over n channels.
inline void silu_mul(const float* __restrict g, const float* __restrict u, float* __restrict out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = silu(g[i]) * u[i];
}

}  // namespace pipeserve
