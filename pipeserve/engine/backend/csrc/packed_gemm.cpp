// y = x w^T (+ bias) with fp32 accumulation for any number of rows, with w packed once at load time
// into panels of 16 output columns, zero past n:
// - fp32 weights: panel p is w[16p .. 16p + 15][k] for every k, k-major ([K][16]);
// - bf16 weights: panel p holds pairs of k, [ceil(K / 2)][16][2] (zero past K): each 32-bit lane is
//   the two products' weights one avx512_bf16 dot-product instruction takes. x is rounded to bf16
//   once per call (what a bf16 model's activations are) and read as pairs.
//
// Library GEMMs take the weight as it lies ([N][K]) and repack it on every call; for the few to a few
// dozen rows of a decode step that costs more than the product (MKL streamed a weight 2-5x slower
// per byte at 4-32 rows than at one). Prepacked, a tile of rows x kPanels panels is a run of
// broadcast-multiply-adds over contiguous panel data: no repacking, no horizontal sums.
//
// Which instructions run is fixed when the library is built for the host (-march=native):
// AVX-512F, plus AVX512-BF16 for bf16 weights, else portable loops the compiler vectorizes as the
// host allows. pipeserve_isa() says which, so the loader can log it.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "vec_math.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using pipeserve::bf16_to_float;
using pipeserve::float_to_bf16;

constexpr int kLanes = 16;        // output columns per panel
constexpr int kRows = 6;          // rows of x per tile: kRows x kPanels accumulators in registers
constexpr int kPanels = 4;
constexpr int64_t kBlockRows = 192;  // rows of x per block: they stay in L2 while the panels stream

// A tile's k steps: one k of fp32 panels (X = float), or one pair of k of bf16 panels (X = a
// uint32_t holding the pair of x values). W is the panel element type; kPer weights per lane per step.
template <typename W>
constexpr int kPer = std::is_same_v<W, float> ? 1 : 2;

template <int MR, int NP>
inline void store(const float (*acc)[NP][kLanes], float* y, int64_t y_stride, const float* bias, int64_t cols) {
  for (int j = 0; j < NP; ++j)
    for (int c = 0; c < kLanes && j * kLanes + c < cols; ++c)
      for (int i = 0; i < MR; ++i) y[i * y_stride + j * kLanes + c] = acc[i][j][c] + (bias ? bias[j * kLanes + c] : 0.0f);
}

#if defined(__AVX512F__)
inline __m512 fma_step(__m512 acc, float x, __m512 w) { return _mm512_fmadd_ps(_mm512_set1_ps(x), w, acc); }
inline __m512 load_panel(const float* p) { return _mm512_loadu_ps(p); }
#if defined(__AVX512BF16__)
inline __m512bh load_panel(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline __m512 fma_step(__m512 acc, uint32_t x, __m512bh w) {
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(static_cast<int>(x)), w);
}
constexpr bool kVectorBf16 = true;
#else
constexpr bool kVectorBf16 = false;
#endif

// MR rows against NP panels. pf: a panel to pull into L2 meanwhile, one cache line per step
// (nullptr: none), so the next group of panels is there when the next group starts.
template <int MR, int NP, typename W, typename X>
inline void tile(const X* __restrict x, int64_t x_stride, const W* __restrict panels, int64_t steps,
                 float* __restrict y, int64_t y_stride, const float* bias, int64_t cols, const W* pf) {
  constexpr int per = kPer<W>;
  const int64_t panel_stride = steps * kLanes * per;
  if constexpr (std::is_same_v<W, float> || kVectorBf16) {
    __m512 acc[MR][NP];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NP; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < steps; ++k) {
      decltype(load_panel(panels)) w[NP];
      for (int j = 0; j < NP; ++j) w[j] = load_panel(panels + j * panel_stride + k * kLanes * per);
      if (pf) _mm_prefetch(reinterpret_cast<const char*>(pf + k * kLanes * per), _MM_HINT_T1);
      // One row (batch-1 decode) streams each panel once with little work per line: ask for each
      // panel's line 2 KB (32 steps of 64 bytes, either dtype) ahead (docs/engine.md has the measurement).
      if constexpr (MR == 1)
        for (int j = 0; j < NP; ++j)
          _mm_prefetch(reinterpret_cast<const char*>(panels + j * panel_stride + (k + 32) * kLanes * per),
                       _MM_HINT_T0);
      for (int i = 0; i < MR; ++i) {
        const X xv = x[i * x_stride + k];
        for (int j = 0; j < NP; ++j) acc[i][j] = fma_step(acc[i][j], xv, w[j]);
      }
    }
    for (int j = 0; j < NP; ++j) {
      const int64_t left = cols - j * kLanes;
      const __mmask16 mask = left >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
      const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + j * kLanes) : _mm512_setzero_ps();
      for (int i = 0; i < MR; ++i) _mm512_mask_storeu_ps(y + i * y_stride + j * kLanes, mask, _mm512_add_ps(acc[i][j], b));
    }
    return;
  }
#else
template <int MR, int NP, typename W, typename X>
inline void tile(const X* __restrict x, int64_t x_stride, const W* __restrict panels, int64_t steps,
                 float* __restrict y, int64_t y_stride, const float* bias, int64_t cols, const W*) {
  constexpr int per = kPer<W>;
  const int64_t panel_stride = steps * kLanes * per;
#endif
  // Portable: the same tile in plain loops (hosts without AVX-512; bf16 without AVX512-BF16).
  float acc[MR][NP][kLanes] = {};
  for (int64_t k = 0; k < steps; ++k)
    for (int i = 0; i < MR; ++i) {
      if constexpr (std::is_same_v<W, float>) {
        const float xv = x[i * x_stride + k];
        for (int j = 0; j < NP; ++j) {
          const float* w = panels + j * panel_stride + k * kLanes;
#pragma omp simd
          for (int c = 0; c < kLanes; ++c) acc[i][j][c] += xv * w[c];
        }
      } else {
        const uint32_t pair = x[i * x_stride + k];
        const float x0 = bf16_to_float(static_cast<uint16_t>(pair)), x1 = bf16_to_float(static_cast<uint16_t>(pair >> 16));
        for (int j = 0; j < NP; ++j) {
          const uint16_t* w = panels + j * panel_stride + k * kLanes * 2;
#pragma omp simd
          for (int c = 0; c < kLanes; ++c) acc[i][j][c] += x0 * bf16_to_float(w[2 * c]) + x1 * bf16_to_float(w[2 * c + 1]);
        }
      }
    }
  store<MR, NP>(acc, y, y_stride, bias, cols);
}

// Every row of a block against NP panels: full tiles, then the rows left over.
template <int NP, typename W, typename X>
void rows(const X* x, int64_t x_stride, const W* panels, int64_t steps, float* y, int64_t y_stride,
          const float* bias, int64_t cols, int64_t m_rows) {
  // The first tile streams its panels from memory; each of the next kPanels tiles, working from L2,
  // pulls one panel of the next group in behind it.
  const int64_t panel_stride = steps * kLanes * kPer<W>;
  const W* next = panels + NP * panel_stride;
  int64_t i = 0;
  for (int t = 0; i + kRows <= m_rows; i += kRows, ++t) {
    const W* pf = t >= 1 && t <= kPanels ? next + (t - 1) * panel_stride : nullptr;
    tile<kRows, NP>(x + i * x_stride, x_stride, panels, steps, y + i * y_stride, y_stride, bias, cols, pf);
  }
  const X* xi = x + i * x_stride;
  float* yi = y + i * y_stride;
  const W* none = nullptr;
  switch (m_rows - i) {
    case 5: tile<5, NP>(xi, x_stride, panels, steps, yi, y_stride, bias, cols, none); break;
    case 4: tile<4, NP>(xi, x_stride, panels, steps, yi, y_stride, bias, cols, none); break;
    case 3: tile<3, NP>(xi, x_stride, panels, steps, yi, y_stride, bias, cols, none); break;
    case 2: tile<2, NP>(xi, x_stride, panels, steps, yi, y_stride, bias, cols, none); break;
    case 1: tile<1, NP>(xi, x_stride, panels, steps, yi, y_stride, bias, cols, none); break;
    default: break;
  }
}

// Threads split the panel groups of each block of rows.
template <typename W, typename X>
void linear(const X* x, int64_t x_stride, const W* packed, const float* bias, float* y, int64_t m_rows, int64_t n,
            int64_t steps, int threads) {
  const int64_t panels = (n + kLanes - 1) / kLanes;
  const int64_t groups = (panels + kPanels - 1) / kPanels;
  const int64_t panel_stride = steps * kLanes * kPer<W>;
  for (int64_t m0 = 0; m0 < m_rows; m0 += kBlockRows) {
    const int64_t block = std::min(kBlockRows, m_rows - m0);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t p0 = g * kPanels;
      const W* panel = packed + p0 * panel_stride;
      const float* b = bias ? bias + p0 * kLanes : nullptr;
      const X* xb = x + m0 * x_stride;
      float* yb = y + m0 * n + p0 * kLanes;
      const int64_t cols = n - p0 * kLanes;
      switch (std::min<int64_t>(kPanels, panels - p0)) {
        case 4: rows<4>(xb, x_stride, panel, steps, yb, n, b, cols, block); break;
        case 3: rows<3>(xb, x_stride, panel, steps, yb, n, b, cols, block); break;
        case 2: rows<2>(xb, x_stride, panel, steps, yb, n, b, cols, block); break;
        default: rows<1>(xb, x_stride, panel, steps, yb, n, b, cols, block); break;
      }
    }
  }
}

}  // namespace

// Bit 0: AVX-512F tiles; bit 1: AVX512-BF16 dot products for bf16 weights (else portable loops).
extern "C" int pipeserve_isa() {
  int isa = 0;
#if defined(__AVX512F__)
  isa |= 1;
#if defined(__AVX512BF16__)
  isa |= 2;
#endif
#endif
  return isa;
}

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

// bf16 w [n, k_len] contiguous into `out`, which holds ceil(n / 16) * 16 * ceil(k_len / 2) * 2 bf16.
extern "C" void pipeserve_pack_weight_bf16(const uint16_t* w, int64_t n, int64_t k_len, uint16_t* out) {
  const int64_t panels = (n + kLanes - 1) / kLanes, pairs = (k_len + 1) / 2;
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t kp = 0; kp < pairs; ++kp)
      for (int c = 0; c < kLanes; ++c)
        for (int e = 0; e < 2; ++e) {
          const int64_t row = p * kLanes + c, k = 2 * kp + e;
          out[((p * pairs + kp) * kLanes + c) * 2 + e] = row < n && k < k_len ? w[row * k_len + k] : 0;
        }
}

// x [m_rows, k_len] (row stride x_stride), packed from pipeserve_pack_weight, y [m_rows, n]
// contiguous.
extern "C" void pipeserve_packed_linear(const float* x, int64_t x_stride, const float* packed, const float* bias,
                                        float* y, int64_t m_rows, int64_t n, int64_t k_len, int threads) {
  linear(x, x_stride, packed, bias, y, m_rows, n, k_len, threads);
}

// The same with a weight from pipeserve_pack_weight_bf16: x (fp32) is rounded to bf16 pairs first.
extern "C" void pipeserve_packed_linear_bf16(const float* x, int64_t x_stride, const uint16_t* packed,
                                             const float* bias, float* y, int64_t m_rows, int64_t n, int64_t k_len,
                                             int threads) {
  const int64_t pairs = (k_len + 1) / 2;
  // Grows to the largest call seen and is reused (each calling thread its own).
  static thread_local std::vector<uint32_t> xb;
  if (static_cast<int64_t>(xb.size()) < m_rows * pairs) xb.resize(m_rows * pairs);
  for (int64_t r = 0; r < m_rows; ++r) {
    const float* row = x + r * x_stride;
    uint32_t* out = xb.data() + r * pairs;
#pragma omp simd
    for (int64_t kp = 0; kp < k_len / 2; ++kp)
      out[kp] = float_to_bf16(row[2 * kp]) | static_cast<uint32_t>(float_to_bf16(row[2 * kp + 1])) << 16;
    if (k_len % 2) out[pairs - 1] = float_to_bf16(row[k_len - 1]);
  }
  linear(xb.data(), pairs, packed, bias, y, m_rows, n, pairs, threads);
}
