// y = x w^T (+ bias) for a few rows of x (decode batches, speculative verification rows), fp32.
// Library GEMMs read a cold weight several times slower per byte at 2-16 rows than their
// one-row product does; here each block of weight rows is read from memory once and every row of
// x is taken against it while it sits in L1, so the product streams the weight as one row does.
#include <algorithm>
#include <cstdint>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int kRows = 4;   // weight rows per block
constexpr int kXRows = 4;  // rows of x per tile: kRows x kXRows accumulators in registers
constexpr int kPassRows = 8;  // rows of x per pass over the whole weight

#if defined(__AVX512F__)
// R weight rows against X rows of x: R * X accumulators, each weight and x vector loaded once per step.
template <int R, int X>
inline void tile(const float* __restrict x, int64_t x_stride, const float* __restrict w, int64_t k_len,
                 float* __restrict y, int64_t y_stride, const float* bias) {
  const int64_t full = k_len / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (k_len - full)) - 1u);
  __m512 acc[X][R];
  for (int m = 0; m < X; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < full; k += 16) {
    __m512 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = _mm512_loadu_ps(w + r * k_len + k);
    for (int m = 0; m < X; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * x_stride + k);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_fmadd_ps(wv[r], xv, acc[m][r]);
    }
  }
  if (tail) {
    __m512 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = _mm512_maskz_loadu_ps(tail, w + r * k_len + full);
    for (int m = 0; m < X; ++m) {
      const __m512 xv = _mm512_maskz_loadu_ps(tail, x + m * x_stride + full);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_fmadd_ps(wv[r], xv, acc[m][r]);
    }
  }
  for (int m = 0; m < X; ++m)
    for (int r = 0; r < R; ++r) y[m * y_stride + r] = _mm512_reduce_add_ps(acc[m][r]) + (bias ? bias[r] : 0.0f);
}

template <int R>
void block(const float* x, int64_t x_stride, const float* w, int64_t k_len, int m_rows, float* y,
           int64_t y_stride, const float* bias) {
  int m = 0;
  for (; m + kXRows <= m_rows; m += kXRows)
    tile<R, kXRows>(x + m * x_stride, x_stride, w, k_len, y + m * y_stride, y_stride, bias);
  switch (m_rows - m) {
    case 3: tile<R, 3>(x + m * x_stride, x_stride, w, k_len, y + m * y_stride, y_stride, bias); break;
    case 2: tile<R, 2>(x + m * x_stride, x_stride, w, k_len, y + m * y_stride, y_stride, bias); break;
    case 1: tile<R, 1>(x + m * x_stride, x_stride, w, k_len, y + m * y_stride, y_stride, bias); break;
    default: break;
  }
}
#else
template <int R>
void block(const float* x, int64_t x_stride, const float* w, int64_t k_len, int m_rows, float* y,
           int64_t y_stride, const float* bias) {
  for (int m = 0; m < m_rows; ++m) {
    const float* xm = x + m * x_stride;
    for (int r = 0; r < R; ++r) {
      const float* wr = w + r * k_len;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t k = 0; k < k_len; ++k) dot += xm[k] * wr[k];
      y[m * y_stride + r] = dot + (bias ? bias[r] : 0.0f);
    }
  }
}
#endif

// One pass over the weight for up to kPassRows rows of x.
void pass(const float* x, int64_t x_stride, const float* w, const float* bias, float* y, int64_t y_stride,
          int m_rows, int64_t n, int64_t k_len, int threads) {
  const int64_t blocks = (n + kRows - 1) / kRows;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t row = b * kRows;
    const float* wb = w + row * k_len;
    const float* bb = bias ? bias + row : nullptr;
    switch (std::min<int64_t>(kRows, n - row)) {
      case 4: block<4>(x, x_stride, wb, k_len, m_rows, y + row, y_stride, bb); break;
      case 3: block<3>(x, x_stride, wb, k_len, m_rows, y + row, y_stride, bb); break;
      case 2: block<2>(x, x_stride, wb, k_len, m_rows, y + row, y_stride, bb); break;
      default: block<1>(x, x_stride, wb, k_len, m_rows, y + row, y_stride, bb);
    }
  }
}

}  // namespace

// x [m_rows, k_len] (row stride x_stride), w [n, k_len] contiguous, y [m_rows, n] contiguous. More
// than kPassRows rows take one pass over the weight per kPassRows: past that, holding more rows per
// block measured several times slower than streaming the weight again.
extern "C" void pipeserve_small_gemm(const float* x, int64_t x_stride, const float* w, const float* bias, float* y,
                                     int m_rows, int64_t n, int64_t k_len, int threads) {
  for (int m = 0; m < m_rows; m += kPassRows)
    pass(x + m * x_stride, x_stride, w, bias, y + m * n, n, std::min(kPassRows, m_rows - m), n, k_len, threads);
}
