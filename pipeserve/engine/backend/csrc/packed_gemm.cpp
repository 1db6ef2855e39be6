// y = x w^T (+ bias) with fp32 accumulation for any number of rows, with w packed once at load time
// into panels of 16 output columns, zero past n:
// - fp32 weights: panel p is w[16p .. 16p + 15][k] for every k, k-major ([K][16]);
// - bf16 weights: panel p holds pairs of k, [ceil(K / 32) * 16][16][2] (zero past K): each 32-bit lane is
//   the two products' weights one avx512_bf16 dot-product instruction takes. x is rounded to bf16
//   once per call (what a bf16 model's activations are) and read as pairs.
//
// Library GEMMs take the weight as it lies ([N][K]) and repack it on every call; for the few to a few
// dozen rows of a decode step that costs more than the product (MKL streamed a weight 2-5x slower
// per byte at 4-32 rows than at one). Prepacked, a tile of rows x kPanels panels is a run of
// broadcast-multiply-adds over contiguous panel data: no repacking, no horizontal sums.
//
// Which instructions run is fixed when the library is built for the host (-march=native):
// AVX-512F, plus AVX512-BF16 for bf16 weights (and AMX tiles for bf16 products of two rows or more,
// where the CPU has them and Linux grants them), else portable loops the compiler vectorizes as the
// host allows. pipeserve_isa() says which, so the loader can log it.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "amx.h"
#include "scratch.h"
#include "vec_math.h"
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

using pipeserve::bf16_to_float;
using pipeserve::float_to_bf16;

constexpr int kLanes = 16;        // output columns per panel
#if defined(PIPESERVE_AVX2)
// 16 registers of 8 lanes: a panel's 16 columns take two, so 6 rows x 1 panel is 12 accumulators,
// beside the panel's two vectors and a broadcast row value.
constexpr int kRows = 6;
constexpr int kPanels = 1;
// bf16 products of this many rows or more widen each panel to fp32 once and run the fp32 tiles on
// it: widening in registers on every pass left the tiles at two thirds of the fp32 rate.
constexpr int64_t kWidenRows = 8;
#else
constexpr int kRows = 8;          // rows of x per tile: kRows x kPanels accumulators in registers
constexpr int kPanels = 3;
#endif
constexpr int kOneRowPanels = 4;  // one row: four panel streams in flight (faster than three: docs/engine.md)
constexpr int64_t kBlockRows = 192;  // rows of x per block: they stay in L2 while the panels stream
// bf16 products of this many rows or more take AMX tiles, where built: at one row the AVX-512 loop
// streams the weight faster (docs/engine.md).
constexpr int64_t kAmxRows = 2;

// Pairs of k per row of a packed bf16 panel: K rounded up to 32 (zeros past it), so an AMX tile of
// 32 k never runs past a panel.
constexpr int64_t bf16_pairs(int64_t k_len) { return (k_len + 31) / 32 * 16; }

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
#elif defined(PIPESERVE_AVX2)
// A bf16 pair's two values as fp32 (bf16 is fp32's top half): the low one, then the high one.
inline __m256 low_half(__m256i pairs) { return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16)); }
inline __m256 high_half(__m256i pairs) {
  return _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// acc[i][j] += the MR rows' pair k (x: the rows rounded to bf16, held as fp32) times the 8 pairs of
// bf16 weights at p, widened. One half of a panel at a time: 12 accumulators, the half's two
// widened vectors and a row's two values fit the 16 registers.
template <int MR, int NP>
inline void widened_fma(const float* x, int64_t x_stride, int64_t k, const uint16_t* p, __m256 (&acc)[MR][NP],
                        int j) {
  const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256 wa = low_half(pairs), wb = high_half(pairs);
#pragma GCC unroll 32
  for (int i = 0; i < MR; ++i) {
    const float* xi = x + i * x_stride + 2 * k;
    acc[i][j] = _mm256_fmadd_ps(_mm256_broadcast_ss(xi + 1), wb,
                                _mm256_fmadd_ps(_mm256_broadcast_ss(xi), wa, acc[i][j]));
  }
}

// The AVX-512 tile's steps on 8-lane registers, two per panel: lo holds a panel's columns 0-7, hi
// 8-15. bf16 panels are widened to fp32 in registers (no bf16 dot product here): each 32-bit lane's
// pair becomes two fp32 vectors, one per k. Every loop over rows and panels is unrolled in full
// (the pragmas): else GCC kept the accumulators on the stack, at a third of the FMA rate.
template <int MR, int NP, typename W, typename X>
inline void tile(const X* __restrict x, int64_t x_stride, const W* __restrict panels, int64_t steps,
                 float* __restrict y, int64_t y_stride, const float* bias, int64_t cols, const W* pf) {
  constexpr int per = kPer<W>;
  const int64_t panel_stride = steps * kLanes * per;
  __m256 lo[MR][NP], hi[MR][NP];
#pragma GCC unroll 32
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 32
    for (int j = 0; j < NP; ++j) {
      lo[i][j] = _mm256_setzero_ps();
      hi[i][j] = _mm256_setzero_ps();
    }
  // Unlike the AVX-512 tile, no prefetch ahead of a single row's panels: on Zen 3 the hardware
  // prefetcher streams them faster alone (docs/engine.md).
  for (int64_t k = 0; k < steps; ++k) {
    if (pf) _mm_prefetch(reinterpret_cast<const char*>(pf + k * kLanes * per), _MM_HINT_T1);
#pragma GCC unroll 32
    for (int j = 0; j < NP; ++j) {
      const W* p = panels + j * panel_stride + k * kLanes * per;
      if constexpr (std::is_same_v<W, float>) {
        const __m256 w0 = _mm256_loadu_ps(p), w1 = _mm256_loadu_ps(p + 8);
#pragma GCC unroll 32
        for (int i = 0; i < MR; ++i) {
          const __m256 xv = _mm256_broadcast_ss(x + i * x_stride + k);
          lo[i][j] = _mm256_fmadd_ps(xv, w0, lo[i][j]);
          hi[i][j] = _mm256_fmadd_ps(xv, w1, hi[i][j]);
        }
      } else {  // x: the rows rounded to bf16, as fp32 (X = float): a pair of k is x[2k], x[2k + 1]
        widened_fma<MR, NP>(x, x_stride, k, p, lo, j);
        widened_fma<MR, NP>(x, x_stride, k, p + 16, hi, j);
      }
    }
  }
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
#pragma GCC unroll 32
  for (int j = 0; j < NP; ++j) {
    // No early exit past the last column (it would keep GCC from unrolling this loop, and so from
    // keeping lo and hi in registers): an empty mask stores nothing.
    const int64_t col = j * kLanes, left = std::max<int64_t>(cols - col, 0);
    const int low = static_cast<int>(std::min<int64_t>(left, 8)), high = static_cast<int>(std::min<int64_t>(left, 16)) - low;
    const __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(low), lane);
    const __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(high), lane);
    const __m256 b0 = bias ? _mm256_maskload_ps(bias + col, m0) : _mm256_setzero_ps();
    const __m256 b1 = bias ? _mm256_maskload_ps(bias + col + 8, m1) : _mm256_setzero_ps();
#pragma GCC unroll 32
    for (int i = 0; i < MR; ++i) {
      _mm256_maskstore_ps(y + i * y_stride + col, m0, _mm256_add_ps(lo[i][j], b0));
      _mm256_maskstore_ps(y + i * y_stride + col + 8, m1, _mm256_add_ps(hi[i][j], b1));
    }
  }
}
#else
template <int MR, int NP, typename W, typename X>
inline void tile(const X* __restrict x, int64_t x_stride, const W* __restrict panels, int64_t steps,
                 float* __restrict y, int64_t y_stride, const float* bias, int64_t cols, const W*) {
  constexpr int per = kPer<W>;
  const int64_t panel_stride = steps * kLanes * per;
#endif
#if !defined(PIPESERVE_AVX2)
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
#endif

// Every row of a block against NP panels: full tiles, then the rows left over.
template <int NP, typename W, typename X>
void rows(const X* x, int64_t x_stride, const W* panels, int64_t steps, float* y, int64_t y_stride,
          const float* bias, int64_t cols, int64_t m_rows) {
#if defined(PIPESERVE_AVX2)
  if constexpr (std::is_same_v<W, uint16_t>)
    if (m_rows >= kWidenRows) {
      static thread_local pipeserve::Scratch scratch;
      float* wide = scratch.hold<float>(NP * steps * 2 * kLanes);
      for (int64_t j = 0; j < NP; ++j)
        for (int64_t k = 0; k < steps; ++k)
          for (int h = 0; h < 2; ++h) {  // a bf16 panel's step: 16 pairs; the fp32 panel's: two rows of 16
            const __m256i pairs = _mm256_loadu_si256(
                reinterpret_cast<const __m256i*>(panels + (j * steps + k) * kLanes * 2 + 16 * h));
            float* out = wide + (j * 2 * steps + 2 * k) * kLanes + 8 * h;
            _mm256_storeu_ps(out, low_half(pairs));
            _mm256_storeu_ps(out + kLanes, high_half(pairs));
          }
      rows<NP>(x, x_stride, static_cast<const float*>(wide), 2 * steps, y, y_stride, bias, cols, m_rows);
      return;
    }
#endif
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
    case 7: tile<7, NP>(xi, x_stride, panels, steps, yi, y_stride, bias, cols, none); break;
    case 6: tile<6, NP>(xi, x_stride, panels, steps, yi, y_stride, bias, cols, none); break;
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
  const int64_t width = m_rows == 1 ? kOneRowPanels : kPanels;  // panels a group
  const int64_t groups = (panels + width - 1) / width;
  const int64_t panel_stride = steps * kLanes * kPer<W>;
  for (int64_t m0 = 0; m0 < m_rows; m0 += kBlockRows) {
    const int64_t block = std::min(kBlockRows, m_rows - m0);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t p0 = g * width;
      const W* panel = packed + p0 * panel_stride;
      const float* b = bias ? bias + p0 * kLanes : nullptr;
      const X* xb = x + m0 * x_stride;
      float* yb = y + m0 * n + p0 * kLanes;
      const int64_t cols = n - p0 * kLanes;
      switch (std::min<int64_t>(width, panels - p0)) {
        case 4: rows<4>(xb, x_stride, panel, steps, yb, n, b, cols, block); break;
        case 3: rows<3>(xb, x_stride, panel, steps, yb, n, b, cols, block); break;
        case 2: rows<2>(xb, x_stride, panel, steps, yb, n, b, cols, block); break;
        default: rows<1>(xb, x_stride, panel, steps, yb, n, b, cols, block); break;
      }
    }
  }
}

#if defined(PIPESERVE_AMX)
// AMX tiles for bf16 weights. The dot-product loop above is compute-bound from a few rows (each
// 64-byte line of weights feeds one vdpbf16ps per row), and oneDNN's AMX GEMM streams a decode
// step's weights at well under the memory's speed; one tdpbf16ps multiplies 16 rows by a 16 x 32
// block of weights. The packed bf16 panel is the tile layout tdpbf16ps takes for its second operand:
// 16 of its pair rows (32 k) are one B tile, 1 KB contiguous.
namespace amx {

using pipeserve::amx::configure;
using pipeserve::amx::granted;

// Tiles: C 0-3 (two row blocks of 16 x two panels, fp32), A 4-5 (the row blocks' 32 k of x), B 6-7
// (the panels' 32 k). Two of each: a tile is not renamed, so a load into the tile the previous
// product still reads would wait for it.

// Whether the C tiles of a pass are all rows and columns of y (else the pass's rows or the last
// panel's columns end inside them).
template <int RB, int PB>
inline bool whole(int64_t rows, int64_t cols) { return rows == 16 * RB && cols >= kLanes * PB; }

// C tiles (RB row blocks x PB panels) = bias (when given: every row of the tiles starts as it) plus a's
// 16 RB rows (bf16 pairs, row stride a_stride uint32) times PB panels from `panel` (stride
// panel_stride), over `chunks` chunks of 32 k. The intrinsics paste
// tile numbers into the instruction text: literals only. stream: the panels come from memory (the
// first pass over them): each one's lines kAhead chunks on are requested meanwhile (the hardware
// prefetcher alone left the stream at 3/4 of the AVX-512 loop's speed; a prefetch past the last
// panel is harmless: prefetches never fault).
constexpr int64_t kAhead = 2;

// The next pair of panels, requested into L2 a few lines a chunk over the current pair's passes after
// the first, so that its first pass finds it there. Only from three passes (65 rows) on: with a
// single later pass the requests crowded it and the product ran slower (docs/engine.md).
struct NextPanels {
  const char* at;
  const char* end;
  int64_t per_chunk;  // lines a chunk

  NextPanels(const uint16_t* next, int64_t count, int64_t panel_stride, int64_t passes, int64_t chunks)
      : at(reinterpret_cast<const char*>(next)), end(at + count * panel_stride * 2) {
    const int64_t lines = (end - at) / 64, later = (passes - 1) * chunks;
    per_chunk = passes > 2 ? (lines + later - 1) / later : 0;
  }
  void request() {
    for (int64_t i = 0; i < per_chunk && at < end; ++i, at += 64) _mm_prefetch(at, _MM_HINT_T1);
  }
};

template <int RB, int PB>
inline void block(const uint32_t* a, int64_t a_stride, const uint16_t* panel, int64_t panel_stride, int64_t chunks,
                  bool stream, const float* bias, NextPanels& next) {
  const int64_t a_bytes = a_stride * 4;
  const uint32_t* a1 = a + 16 * a_stride;
  const uint16_t* p1 = panel + panel_stride;
  if (bias) {  // row stride 0: every row of the C tile starts as the panel's 16 biases
    _tile_loadd(0, bias, 0);
    if constexpr (PB > 1) _tile_loadd(1, bias + kLanes, 0);
    if constexpr (RB > 1) _tile_loadd(2, bias, 0);
    if constexpr (RB > 1 && PB > 1) _tile_loadd(3, bias + kLanes, 0);
  } else {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t c = 0; c < chunks; ++c) {
    if (stream)
      for (int64_t line = 0; line < 1024; line += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(panel + (c + kAhead) * 512) + line, _MM_HINT_T0);
        if constexpr (PB > 1) _mm_prefetch(reinterpret_cast<const char*>(p1 + (c + kAhead) * 512) + line, _MM_HINT_T0);
      }
    if (!stream) next.request();
    _tile_loadd(6, panel + c * 512, 64);
    if constexpr (PB > 1) _tile_loadd(7, p1 + c * 512, 64);
    _tile_loadd(4, a + c * 16, a_bytes);
    if constexpr (RB > 1) _tile_loadd(5, a1 + c * 16, a_bytes);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (PB > 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (RB > 1) _tile_dpbf16ps(2, 5, 6);
    if constexpr (RB > 1 && PB > 1) _tile_dpbf16ps(3, 5, 7);
  }
}

// Rows [0, rows) of the C tiles into y (row stride y_stride; cols valid columns from the first
// panel's start). Whole tiles go straight to y, their bias already in them (pass); partial ones
// through a buffer, bias added here.
template <int RB, int PB>
inline void drain(float* y, int64_t y_stride, int64_t rows, int64_t cols, const float* bias) {
  if (whole<RB, PB>(rows, cols)) {
    const int64_t bytes = y_stride * 4;
    _tile_stored(0, y, bytes);
    if constexpr (PB > 1) _tile_stored(1, y + kLanes, bytes);
    if constexpr (RB > 1) _tile_stored(2, y + 16 * y_stride, bytes);
    if constexpr (RB > 1 && PB > 1) _tile_stored(3, y + 16 * y_stride + kLanes, bytes);
    return;
  }
  alignas(64) float c[2][32][16];  // [panel][row][lane]
  _tile_stored(0, c[0][0], 64);
  if constexpr (PB > 1) _tile_stored(1, c[1][0], 64);
  if constexpr (RB > 1) _tile_stored(2, c[0][16], 64);
  if constexpr (RB > 1 && PB > 1) _tile_stored(3, c[1][16], 64);
  for (int j = 0; j < PB; ++j) {
    const int64_t left = cols - j * kLanes;
    if (left <= 0) break;
    const __mmask16 mask = pipeserve::lanes(left);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + j * kLanes) : _mm512_setzero_ps();
    for (int64_t i = 0; i < rows; ++i)
      _mm512_mask_storeu_ps(y + i * y_stride + j * kLanes, mask, _mm512_add_ps(_mm512_load_ps(c[j][i]), b));
  }
}

// One pass: `rows` rows of x (from a) against PB panels into y. Whole tiles start from the bias;
// drain adds it to partial ones.
template <int RB, int PB>
inline void pass(const uint32_t* a, int64_t a_stride, const uint16_t* panel, int64_t panel_stride, int64_t chunks,
                 bool stream, float* y, int64_t n, int64_t rows, int64_t cols, const float* bias, NextPanels& next) {
  block<RB, PB>(a, a_stride, panel, panel_stride, chunks, stream, whole<RB, PB>(rows, cols) ? bias : nullptr, next);
  drain<RB, PB>(y, n, rows, cols, bias);
}

// Every row of x against PB panels, 32 rows a pass.
template <int PB>
inline void panels_rows(const uint32_t* a, int64_t a_stride, const uint16_t* panel, int64_t panel_stride,
                        int64_t chunks, float* y, int64_t n, int64_t m_rows, int64_t cols, const float* bias,
                        NextPanels next) {
  for (int64_t m0 = 0; m0 < m_rows; m0 += 32) {
    const int64_t rows = std::min<int64_t>(32, m_rows - m0);
    if (rows > 16)
      pass<2, PB>(a + m0 * a_stride, a_stride, panel, panel_stride, chunks, m0 == 0, y + m0 * n, n, rows, cols, bias,
                  next);
    else
      pass<1, PB>(a + m0 * a_stride, a_stride, panel, panel_stride, chunks, m0 == 0, y + m0 * n, n, rows, cols, bias,
                  next);
  }
}

// y [m_rows, n] = a (bf16 pairs [m_rows rounded up to 16, pairs] at row stride a_stride, zero past
// m_rows; pairs a multiple of 16) x the packed panels. Each pair of panels is read from memory once:
// its passes of 32 rows after the first find it in cache. The tiles are left configured, not
// released: a release costs more than a 64-row product's drain (docs/engine.md), and every tile
// user here and in oneDNN loads its own configuration first.
void linear(const uint32_t* a, int64_t a_stride, int64_t pairs, const uint16_t* packed, const float* bias, float* y,
            int64_t m_rows, int64_t n, int threads) {
  const int64_t panels = (n + kLanes - 1) / kLanes, panel_stride = pairs * kLanes * 2, chunks = pairs / 16;
  const int64_t pairs_of_panels = (panels + 1) / 2, passes = (m_rows + 31) / 32;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    configure();
#pragma omp for schedule(static)
    for (int64_t g = 0; g < pairs_of_panels; ++g) {
      const int64_t p = 2 * g;
      const uint16_t* panel = packed + p * panel_stride;
      const float* b = bias ? bias + p * kLanes : nullptr;
      const int64_t cols = n - p * kLanes;
      const NextPanels next(panel + 2 * panel_stride, std::clamp<int64_t>(panels - p - 2, 0, 2), panel_stride, passes,
                            chunks);
      if (p + 1 < panels)
        panels_rows<2>(a, a_stride, panel, panel_stride, chunks, y + p * kLanes, n, m_rows, cols, b, next);
      else
        panels_rows<1>(a, a_stride, panel, panel_stride, chunks, y + p * kLanes, n, m_rows, cols, b, next);
    }
  }
}

}  // namespace amx
#endif

// A row of x as bf16 pairs (a pair is two consecutive bf16, so this is the row in bf16; the last
// pair of an odd k_len has a zero high half). AVX512-BF16 rounds 32 values an instruction, to the
// same bits as float_to_bf16 except denormal inputs, which it flushes to zero: the same products,
// as the dot-product instructions that read these pairs (vdpbf16ps, tdpbf16ps) take denormal bf16
// as zero.
inline void to_pairs(const float* x, int64_t k_len, uint32_t* out) {
  int64_t i = 0;
#if defined(__AVX512BF16__) && defined(PIPESERVE_AVX512)
  for (; i + 32 <= k_len; i += 32) {
    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i));
    _mm512_storeu_si512(out + i / 2, reinterpret_cast<const __m512i&>(v));
  }
#endif
  for (; i + 2 <= k_len; i += 2)
    out[i / 2] = float_to_bf16(x[i]) | static_cast<uint32_t>(float_to_bf16(x[i + 1])) << 16;
  if (i < k_len) out[i / 2] = float_to_bf16(x[i]);
}

}  // namespace

// Bit 0: AVX-512F tiles; bit 1: AVX512-BF16 dot products for bf16 weights (else portable loops);
// bit 2: AMX tiles for bf16 products of kAmxRows rows or more (built, and granted by the kernel);
// bit 3: AVX2 tiles for both dtypes (no AVX-512).
extern "C" int pipeserve_isa() {
  int isa = 0;
#if defined(__AVX512F__)
  isa |= 1;
#if defined(__AVX512BF16__)
  isa |= 2;
#endif
#endif
#if defined(PIPESERVE_AVX2)
  isa |= 8;
#endif
#if defined(PIPESERVE_AMX)
  if (amx::granted()) isa |= 4;
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

// bf16 w [n, k_len] contiguous into `out`, which holds ceil(n / 16) * 16 * bf16_pairs(k_len) * 2 bf16.
extern "C" void pipeserve_pack_weight_bf16(const uint16_t* w, int64_t n, int64_t k_len, uint16_t* out) {
  const int64_t panels = (n + kLanes - 1) / kLanes, pairs = bf16_pairs(k_len);
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
  const int64_t pairs = bf16_pairs(k_len);
#if defined(PIPESERVE_AVX2)
  // The AVX2 tiles broadcast each x value from memory: the rows rounded to bf16, held as fp32, zero
  // past k_len (a row one cache line longer than its pairs' values, as below).
  const int64_t width = 2 * pairs + 16;
  static thread_local pipeserve::Scratch scratch;
  float* xf = scratch.hold<float>(m_rows * width);
  for (int64_t r = 0; r < m_rows; ++r)
    for (int64_t i = 0; i < 2 * pairs; ++i)
      xf[r * width + i] = i < k_len ? bf16_to_float(float_to_bf16(x[r * x_stride + i])) : 0.0f;
  linear(xf, width, packed, bias, y, m_rows, n, pairs, threads);
#else
#if defined(PIPESERVE_AMX)
  const bool tiles = m_rows >= kAmxRows && amx::granted();
#else
  constexpr bool tiles = false;
#endif
  // AMX reads x in whole tiles of 16 rows: the rows past m_rows are zeros. A row is one cache line
  // longer than its pairs: at k_len a multiple of 2048 a tile's 16 rows would otherwise share one L1
  // set.
  const int64_t rows_held = tiles ? (m_rows + 15) / 16 * 16 : m_rows, stride = pairs + 16;
  static thread_local pipeserve::Scratch scratch;
  uint32_t* xb = scratch.hold<uint32_t>(rows_held * stride);
  for (int64_t r = 0; r < m_rows; ++r) {
    uint32_t* out = xb + r * stride;
    to_pairs(x + r * x_stride, k_len, out);
    std::fill(out + (k_len + 1) / 2, out + pairs, 0u);
  }
#if defined(PIPESERVE_AMX)
  if (tiles) {
    std::fill(xb + m_rows * stride, xb + rows_held * stride, 0u);
    amx::linear(xb, stride, pairs, packed, bias, y, m_rows, n, threads);
    return;
  }
#endif
  linear(xb, stride, packed, bias, y, m_rows, n, pairs, threads);
#endif
}
