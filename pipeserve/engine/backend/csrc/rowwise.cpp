// Row-wise kernels for the per-op path's many-row steps (prefill chunks, which the native step leaves
// to the per-op forward pass): RMSNorm after a residual add, SiLU-and-mul and rotate-half RoPE, each
// row once, the rows split over `threads`. In torch the same work is several passes over the rows:
// the add, the square, the mean, the scale and the weight; SiLU then the product; RoPE's two halves,
// their concatenation, two products and the sum.
//
// fp32 rows (dtype 0) run the native step's own code (vec_math.h). bf16 rows (dtype 1) compute in fp32
// and round to bf16 where the torch ops they replace do (the reference backend's order): the residual
// sum, the normalized row before the weight, the weighted row; SiLU before the product, the product;
// RoPE once, at the end.
#include <cstdint>
#include <vector>

#include "vec_math.h"

namespace {

using pipeserve::bf16_to_float;
using pipeserve::float_to_bf16;

inline float round_bf16(float x) { return bf16_to_float(float_to_bf16(x)); }

#if defined(PIPESERVE_AVX512)
using pipeserve::lanes;
using pipeserve::load_bf16x16;
using pipeserve::round_bf16x16;
using pipeserve::store_bf16x16;

// rms_norm_bf16 (below) 16 channels at a time: the same roundings.
void rms_norm_bf16_avx512(const uint16_t* x, const uint16_t* add, const uint16_t* w, float eps, uint16_t* out,
                          uint16_t* resid, int64_t n, float* row) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes(n - i);
    __m512 s = load_bf16x16(x + i, m);
    if (add != nullptr) {
      store_bf16x16(resid + i, _mm512_add_ps(s, load_bf16x16(add + i, m)), m);
      s = load_bf16x16(resid + i, m);
    }
    _mm512_mask_storeu_ps(row + i, m, s);
    acc = _mm512_fmadd_ps(s, s, acc);
  }
  const float inv = 1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(n) + eps);
  const __m512 scale = _mm512_set1_ps(inv);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes(n - i);
    const __m512 normed = round_bf16x16(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, row + i), scale));
    store_bf16x16(out + i, _mm512_mul_ps(load_bf16x16(w + i, m), normed), m);
  }
}
#endif

void rms_norm_bf16(const uint16_t* x, const uint16_t* add, const uint16_t* w, float eps, uint16_t* out,
                   uint16_t* resid, int64_t n, float* row) {
#if defined(PIPESERVE_AVX512)
  rms_norm_bf16_avx512(x, add, w, eps, out, resid, n, row);
#else
  for (int64_t i = 0; i < n; ++i) {
    float s = bf16_to_float(x[i]);
    if (add != nullptr) {
      const uint16_t r = float_to_bf16(s + bf16_to_float(add[i]));
      resid[i] = r;
      s = bf16_to_float(r);
    }
    row[i] = s;
  }
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += row[i] * row[i];
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = float_to_bf16(bf16_to_float(w[i]) * round_bf16(row[i] * inv));
#endif
}

void silu_mul_bf16(const uint16_t* g, const uint16_t* u, uint16_t* out, int64_t n) {
#if defined(PIPESERVE_AVX512)
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes(n - i);
    const __m512 act = round_bf16x16(pipeserve::silu16(load_bf16x16(g + i, m)));
    store_bf16x16(out + i, _mm512_mul_ps(act, load_bf16x16(u + i, m)), m);
  }
#else
#pragma omp simd
  for (int64_t i = 0; i < n; ++i)
    out[i] = float_to_bf16(round_bf16(pipeserve::silu(bf16_to_float(g[i]))) * bf16_to_float(u[i]));
#endif
}

void rope_bf16(uint16_t* x, int heads, int head_dim, const float* row, int rot_dim) {
  const int half = rot_dim / 2;
  const float* cos = row;
  const float* sin = row + half;
  for (int h = 0; h < heads; ++h) {
    uint16_t* a = x + static_cast<int64_t>(h) * head_dim;
    uint16_t* b = a + half;
    for (int i = 0; i < half; ++i) {
      const float x1 = bf16_to_float(a[i]), x2 = bf16_to_float(b[i]);
      a[i] = float_to_bf16(x1 * cos[i] - x2 * sin[i]);
      b[i] = float_to_bf16(x2 * cos[i] + x1 * sin[i]);
    }
  }
}

}  // namespace

// out[r] = rms_norm(x[r] (+ add[r])) * w; with add, resid[r] = x[r] + add[r] (the new residual stream).
// Rows of x and add strided (in elements); out and resid [rows, n] contiguous; every tensor of `dtype`.
extern "C" void pipeserve_rms_norm_rows(int dtype, const void* x, int64_t x_stride, const void* add,
                                        int64_t add_stride, const void* w, float eps, void* out, void* resid,
                                        int64_t rows, int64_t n, int threads) {
  if (dtype == 1) {
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
      std::vector<float> row(n);
#pragma omp for schedule(static)
      for (int64_t r = 0; r < rows; ++r)
        rms_norm_bf16(static_cast<const uint16_t*>(x) + r * x_stride,
                      add == nullptr ? nullptr : static_cast<const uint16_t*>(add) + r * add_stride,
                      static_cast<const uint16_t*>(w), eps, static_cast<uint16_t*>(out) + r * n,
                      resid == nullptr ? nullptr : static_cast<uint16_t*>(resid) + r * n, n, row.data());
    }
    return;
  }
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = static_cast<const float*>(x) + r * x_stride;
    if (add != nullptr) {
      const float* a = static_cast<const float*>(add) + r * add_stride;
      float* s = static_cast<float*>(resid) + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) s[i] = xr[i] + a[i];
      xr = s;
    }
    pipeserve::rms_norm(xr, static_cast<const float*>(w), eps, static_cast<float*>(out) + r * n, n);
  }
}

// out[r] = silu(gate) * up for rows [gate | up] (2 * inter elements, rows `stride` apart).
extern "C" void pipeserve_silu_and_mul_rows(int dtype, const void* gate_up, int64_t stride, void* out,
                                            int64_t rows, int64_t inter, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t r = 0; r < rows; ++r) {
    if (dtype == 1) {
      const uint16_t* g = static_cast<const uint16_t*>(gate_up) + r * stride;
      silu_mul_bf16(g, g + inter, static_cast<uint16_t*>(out) + r * inter, inter);
    } else {
      const float* g = static_cast<const float*>(gate_up) + r * stride;
      pipeserve::silu_mul(g, g + inter, static_cast<float*>(out) + r * inter, inter);
    }
  }
}

// Rotates `heads` heads of head_dim at each row of x (rows `row_stride` elements apart, heads packed) in
// place, row r at positions[r] of the fp32 table [positions, table_stride] (cos then sin, rot_dim).
extern "C" void pipeserve_rope_rows(int dtype, void* x, int64_t row_stride, int heads, int head_dim,
                                    const float* table, int64_t table_stride, const int64_t* positions,
                                    int64_t rows, int rot_dim, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = table + positions[r] * table_stride;
    if (dtype == 1)
      rope_bf16(static_cast<uint16_t*>(x) + r * row_stride, heads, head_dim, row, rot_dim);
    else
      pipeserve::rope(static_cast<float*>(x) + r * row_stride, heads, head_dim, row, rot_dim);
  }
}
