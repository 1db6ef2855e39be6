// y = x w^T (+ bias) in fp32 for any number of rows, with w packed once at load time into panels of
// 16 output columns: panel p is w[16p .. 16p + 15][k] for every k, k-major ([K][16]), zero past n.
//
// Library GEMMs take the weight as it lies ([N][K]) and repack it on every call; for the few to a few
// dozen rows of a decode step that costs more than the product (MKL streamed a weight 2-5x slower
// per byte at 4-32 rows than at one). Prepacked, a tile of rows x kPanels panels is a run of
// broadcast-multiply-adds over contiguous panel data: no repacking, no horizontal sums.
#include <algorithm>
#include <cstdint>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int kLanes = 16;        // output columns per panel
constexpr int kRows = 6;          // rows of x per tile: kRows x kPanels accumulators in registers
constexpr int kPanels = 4;
constexpr int64_t kBlockRows = 192;  // rows of x per block: they stay in L2 while the panels stream

#if defined(__AVX512F__)
// MR rows against NP panels. pf: a panel to pull into L2 meanwhile, one cache line per k (nullptr:
// none), so the next group of panels is there when the next group starts.
template <int MR, int NP>
inline void tile(const float* __restrict x, int64_t x_stride, const float* __restrict panels, int64_t k_len,
                 float* __restrict y, int64_t y_stride, const float* bias, int64_t cols, const float* pf) {
  const int64_t panel_stride = k_len * kLanes;
  __m512 acc[MR][NP];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NP; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_len; ++k) {
    __m512 w[NP];
    for (int j = 0; j < NP; ++j) w[j] = _mm512_loadu_ps(panels + j * panel_stride + k * kLanes);
    if (pf) _mm_prefetch(reinterpret_cast<const char*>(pf + k * kLanes), _MM_HINT_T1);
    // One row (batch-1 decode) streams each panel once with little work per line: ask for each
    // panel's line 2 KB ahead (docs/engine.md has the measurement).
    if constexpr (MR == 1)
      for (int j = 0; j < NP; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(panels + j * panel_stride + (k + 32) * kLanes), _MM_HINT_T0);
    for (int i = 0; i < MR; ++i) {
      const __m512 xv = _mm512_set1_ps(x[i * x_stride + k]);
      for (int j = 0; j < NP; ++j) acc[i][j] = _mm512_fmadd_ps(xv, w[j], acc[i][j]);
    }
  }
  for (int j = 0; j < NP; ++j) {
    const int64_t left = cols - j * kLanes;
    const __mmask16 mask = left >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + j * kLanes) : _mm512_setzero_ps();
    for (int i = 0; i < MR; ++i) _mm512_mask_storeu_ps(y + i * y_stride + j * kLanes, mask, _mm512_add_ps(acc[i][j], b));
  }
}
#else
template <int MR, int NP>
inline void tile(const float* __restrict x, int64_t x_stride, const float* __restrict panels, int64_t k_len,
                 float* __restrict y, int64_t y_stride, const float* bias, int64_t cols, const float*) {
  const int64_t panel_stride = k_len * kLanes;
  float acc[MR][NP][kLanes] = {};
  for (int64_t k = 0; k < k_len; ++k)
    for (int i = 0; i < MR; ++i) {
      const float xv = x[i * x_stride + k];
      for (int j = 0; j < NP; ++j) {
        const float* w = panels + j * panel_stride + k * kLanes;
#pragma omp simd
        for (int c = 0; c < kLanes; ++c) acc[i][j][c] += xv * w[c];
      }
    }
  for (int j = 0; j < NP; ++j)
    for (int c = 0; c < kLanes && j * kLanes + c < cols; ++c)
      for (int i = 0; i < MR; ++i) y[i * y_stride + j * kLanes + c] = acc[i][j][c] + (bias ? bias[j * kLanes + c] : 0.0f);
}
#endif

// Every row of a block against NP panels: full tiles, then the rows left over.
template <int NP>
void rows(const float* x, int64_t x_stride, const float* panels, int64_t k_len, float* y, int64_t y_stride,
          const float* bias, int64_t cols, int64_t m_rows) {
  // The first tile streams its panels from memory; each of the next kPanels tiles, working from L2,
  // pulls one panel of the next group in behind it.
  const int64_t panel_stride = k_len * kLanes;
  const float* next = panels + NP * panel_stride;
  int64_t i = 0;
  for (int t = 0; i + kRows <= m_rows; i += kRows, ++t) {
    const float* pf = t >= 1 && t <= kPanels ? next + (t - 1) * panel_stride : nullptr;
    tile<kRows, NP>(x + i * x_stride, x_stride, panels, k_len, y + i * y_stride, y_stride, bias, cols, pf);
  }
  const float* xi = x + i * x_stride;
  float* yi = y + i * y_stride;
  switch (m_rows - i) {
    case 5: tile<5, NP>(xi, x_stride, panels, k_len, yi, y_stride, bias, cols, nullptr); break;
    case 4: tile<4, NP>(xi, x_stride, panels, k_len, yi, y_stride, bias, cols, nullptr); break;
    case 3: tile<3, NP>(xi, x_stride, panels, k_len, yi, y_stride, bias, cols, nullptr); break;
    case 2: tile<2, NP>(xi, x_stride, panels, k_len, yi, y_stride, bias, cols, nullptr); break;
    case 1: tile<1, NP>(xi, x_stride, panels, k_len, yi, y_stride, bias, cols, nullptr); break;
    default: break;
  }
}

}  // namespace

// w [n, k_len] contiguous into `out`, which holds ceil(n / 16) * 16 * k_len floats.
extern "C" void pipeserve_pack_weight(const float* w, int64_t n, int64_t k_len, float* out) {
  const int64_t panels = (n + kLanes - 1) / kLanes;
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t k = 0; k < k_len; ++k)
      for (int c = 0; c < kLanes; ++c) {
        const int64_t row = p * kLanes + c;
        out[(p * k_len + k) * kLanes + c] = row < n ? w[row * k_len + k] : 0.0f;
      }
}

// x [m_rows, k_len] (row stride x_stride), packed from pipeserve_pack_weight, y [m_rows, n]
// contiguous. Threads split the panel groups.
extern "C" void pipeserve_packed_linear(const float* x, int64_t x_stride, const float* packed, const float* bias,
                                        float* y, int64_t m_rows, int64_t n, int64_t k_len, int threads) {
  const int64_t panels = (n + kLanes - 1) / kLanes;
  const int64_t groups = (panels + kPanels - 1) / kPanels;
  for (int64_t m0 = 0; m0 < m_rows; m0 += kBlockRows) {
    const int64_t block = std::min(kBlockRows, m_rows - m0);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t p0 = g * kPanels;
      const float* panel = packed + p0 * k_len * kLanes;
      const float* b = bias ? bias + p0 * kLanes : nullptr;
      const float* xb = x + m0 * x_stride;
      float* yb = y + m0 * n + p0 * kLanes;
      const int64_t cols = n - p0 * kLanes;
      switch (std::min<int64_t>(kPanels, panels - p0)) {
        case 4: rows<4>(xb, x_stride, panel, k_len, yb, n, b, cols, block); break;
        case 3: rows<3>(xb, x_stride, panel, k_len, yb, n, b, cols, block); break;
        case 2: rows<2>(xb, x_stride, panel, k_len, yb, n, b, cols, block); break;
        default: rows<1>(xb, x_stride, panel, k_len, yb, n, b, cols, block); break;
      }
    }
  }
}
