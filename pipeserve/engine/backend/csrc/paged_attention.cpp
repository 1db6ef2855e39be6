// Paged KV store and decode attention for the CPU backend, built by native.py with the host's C++
// compiler and called through ctypes: no torch headers, so the build takes about a second.
//
// Cache layout (one layer): [pages, page_size, kv_heads, head_dim], contiguous. Queries and outputs
// are fp32; the cache holds fp32, bf16 or fp16 (the model's dtype). Decode rows attend to keys
// [max(0, len - window), len) of their own pages: one query token per row, at position len - 1.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace {

constexpr int kMaxGroup = 64;  // query heads per KV head (native.py checks it)

struct bf16 {
  uint16_t bits;
};

inline float to_float(float x) { return x; }
inline float to_float(_Float16 x) { return static_cast<float>(x); }
inline float to_float(bf16 x) {
  uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

using pipeserve::exp_nonpositive;

// Each of the group's score rows (n apiece) becomes exp(score - its max), in place; inv[g] gets 1 /
// row g's sum. max_of[g]: the row's maximum when the caller tracked it, else nullptr.
inline void softmax_rows(float* __restrict scores, int group, int n, const float* max_of, float* inv) {
  for (int g = 0; g < group; ++g) {
    float* __restrict s = scores + static_cast<size_t>(g) * n;
    float m = s[0];
    if (max_of != nullptr) {
      m = max_of[g];
    } else {
#pragma omp simd reduction(max : m)
      for (int i = 1; i < n; ++i) m = std::max(m, s[i]);
    }
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int i = 0; i < n; ++i) {
      const float e = exp_nonpositive(s[i] - m);
      s[i] = e;
      sum += e;
    }
    inv[g] = 1.0f / sum;
  }
}

// One (row, KV head): the scores of its group's query heads against every key, softmax, then the
// weighted values; each key and value row is read once, for the whole group. D > 0 fixes head_dim
// at compile time.
template <typename T, int D>
void decode_head(const float* __restrict qh, const T* __restrict k_cache, const T* __restrict v_cache,
                 const int32_t* __restrict table, int64_t page_stride, int64_t token_stride, int page_size,
                 int head_dim, int group, int start, int len, float scale, float* __restrict oh,
                 std::vector<float>& scores) {
  const int dim = D > 0 ? D : head_dim;
  const int n = len - start;
  scores.resize(static_cast<size_t>(group) * n);
  float* __restrict sc = scores.data();
  for (int t = start; t < len; ++t) {
    const T* __restrict k = k_cache + table[t / page_size] * page_stride + (t % page_size) * token_stride;
    for (int g = 0; g < group; ++g) {
      const float* __restrict qg = qh + g * dim;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int d = 0; d < dim; ++d) dot += qg[d] * to_float(k[d]);
      sc[static_cast<size_t>(g) * n + (t - start)] = dot * scale;
    }
  }
  float inv[kMaxGroup];
  softmax_rows(sc, group, n, nullptr, inv);
  std::fill(oh, oh + static_cast<int64_t>(group) * dim, 0.0f);
  for (int t = start; t < len; ++t) {
    const T* __restrict v = v_cache + table[t / page_size] * page_stride + (t % page_size) * token_stride;
    for (int g = 0; g < group; ++g) {
      const float p = sc[static_cast<size_t>(g) * n + (t - start)];
      float* __restrict og = oh + g * dim;
#pragma omp simd
      for (int d = 0; d < dim; ++d) og[d] += p * to_float(v[d]);
    }
  }
  for (int g = 0; g < group; ++g) {
    float* __restrict og = oh + g * dim;
#pragma omp simd
    for (int d = 0; d < dim; ++d) og[d] *= inv[g];
  }
}

// The same for small head_dim (D under 32), where a dot product over D channels is mostly its
// horizontal sum: the vectors run across a page's tokens instead (strided loads, one per channel).
template <typename T, int D>
void decode_head_small(const float* __restrict qh, const T* __restrict k_cache, const T* __restrict v_cache,
                       const int32_t* __restrict table, int64_t page_stride, int64_t token_stride, int page_size,
                       int group, int start, int len, float scale, float* __restrict oh,
                       std::vector<float>& scores) {
  const int n = len - start;
  scores.resize(static_cast<size_t>(group) * n);
  float* __restrict sc = scores.data();
  for (int t0 = start; t0 < len;) {
    const int in_page = t0 % page_size;
    const int count = std::min(page_size - in_page, len - t0);
    const T* __restrict k = k_cache + table[t0 / page_size] * page_stride + in_page * token_stride;
    for (int g = 0; g < group; ++g) {
      float* __restrict s = sc + static_cast<size_t>(g) * n + (t0 - start);
      const float* __restrict qg = qh + g * D;
#pragma omp simd
      for (int j = 0; j < count; ++j) {
        float dot = 0.0f;
        for (int d = 0; d < D; ++d) dot += qg[d] * to_float(k[j * token_stride + d]);
        s[j] = dot * scale;
      }
    }
    t0 += count;
  }
  float inv[kMaxGroup];
  softmax_rows(sc, group, n, nullptr, inv);
  for (int g = 0; g < group; ++g) {
    const float* __restrict p = sc + static_cast<size_t>(g) * n;
    float acc[D] = {};
    for (int t0 = start; t0 < len;) {
      const int in_page = t0 % page_size;
      const int count = std::min(page_size - in_page, len - t0);
      const T* __restrict v = v_cache + table[t0 / page_size] * page_stride + in_page * token_stride;
      const float* __restrict pp = p + (t0 - start);
      for (int d = 0; d < D; ++d) {
        float part = 0.0f;
#pragma omp simd reduction(+ : part)
        for (int j = 0; j < count; ++j) part += pp[j] * to_float(v[j * token_stride + d]);
        acc[d] += part;
      }
      t0 += count;
    }
    for (int d = 0; d < D; ++d) oh[g * D + d] = acc[d] * inv[g];
  }
}

#if defined(PIPESERVE_AVX512)
// decode_head_small for an fp32 cache with AVX-512: each channel of a page's (up to 16) tokens is one
// gather, so scores and values take one fused multiply-add per channel and query head, and the
// horizontal sums wait until the end of the row.
// Channel d of the (up to 16) tokens from t0 to the end of t0's page, or to len: out[d], one lane per
// token; count gets their number, the result their lanes.
template <int D>
inline __mmask16 gather_chunk(const float* cache, const int32_t* table, int64_t page_stride, int64_t token_stride,
                              int page_size, __m512i idx, int t0, int len, __m512* out, int& count) {
  const int in_page = t0 % page_size;
  count = std::min({page_size - in_page, len - t0, 16});
  const __mmask16 mask = pipeserve::lanes(count);
  const float* base = cache + table[t0 / page_size] * page_stride + in_page * token_stride;
  for (int d = 0; d < D; ++d) out[d] = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mask, idx, base + d, 4);
  return mask;
}

template <int D>
void decode_head_small_avx512(const float* __restrict qh, const float* __restrict k_cache,
                              const float* __restrict v_cache, const int32_t* __restrict table, int64_t page_stride,
                              int64_t token_stride, int page_size, int group, int start, int len, float scale,
                              float* __restrict oh, std::vector<float>& scores) {
  const int n = len - start;
  scores.resize(static_cast<size_t>(group) * n + 16);
  float* __restrict sc = scores.data();
  const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32(static_cast<int>(token_stride)));
  const __m512 zero = _mm512_setzero_ps();
  __m512 running_max[kMaxGroup];
  for (int g = 0; g < group; ++g) running_max[g] = _mm512_set1_ps(-FLT_MAX);
  for (int t0 = start; t0 < len;) {
    __m512 kd[D];
    int count;
    const __mmask16 mask = gather_chunk<D>(k_cache, table, page_stride, token_stride, page_size, idx, t0, len, kd,
                                           count);
    for (int g = 0; g < group; ++g) {
      const float* qg = qh + g * D;
      __m512 s = zero;
      for (int d = 0; d < D; ++d) s = _mm512_fmadd_ps(_mm512_set1_ps(qg[d]), kd[d], s);
      s = _mm512_mul_ps(s, _mm512_set1_ps(scale));
      running_max[g] = _mm512_mask_max_ps(running_max[g], mask, running_max[g], s);
      _mm512_mask_storeu_ps(sc + static_cast<size_t>(g) * n + (t0 - start), mask, s);
    }
    t0 += count;
  }
  float m[kMaxGroup], inv[kMaxGroup];
  for (int g = 0; g < group; ++g) m[g] = _mm512_reduce_max_ps(running_max[g]);
  softmax_rows(sc, group, n, m, inv);
  __m512 acc[kMaxGroup][D];
  for (int g = 0; g < group; ++g)
    for (int d = 0; d < D; ++d) acc[g][d] = zero;
  for (int t0 = start; t0 < len;) {
    __m512 vd[D];
    int count;
    const __mmask16 mask = gather_chunk<D>(v_cache, table, page_stride, token_stride, page_size, idx, t0, len, vd,
                                           count);
    for (int g = 0; g < group; ++g) {
      const __m512 p = _mm512_maskz_loadu_ps(mask, sc + static_cast<size_t>(g) * n + (t0 - start));
      for (int d = 0; d < D; ++d) acc[g][d] = _mm512_fmadd_ps(p, vd[d], acc[g][d]);
    }
    t0 += count;
  }
  for (int g = 0; g < group; ++g)
    for (int d = 0; d < D; ++d) oh[g * D + d] = _mm512_reduce_add_ps(acc[g][d]) * inv[g];
}

#endif

#if defined(PIPESERVE_SIMD)
namespace simd = pipeserve::simd;
using simd::vec;

// kWidth cache values as fp32: an fp32 cache's as they are, a bf16 cache's widened.
inline vec load_row(const float* p) { return simd::load(p); }
inline vec load_row(const bf16* p) { return simd::load(reinterpret_cast<const uint16_t*>(p)); }

// One head's row of a cache (D values) requested into L2: a row of the next page, read after this one.
template <typename T, int D>
inline void prefetch_row(const T* row) {
  for (size_t byte = 0; byte < D * sizeof(T); byte += 64)
    _mm_prefetch(reinterpret_cast<const char*>(row) + byte, _MM_HINT_T1);
}

// The scores of G query heads (registers for the block) against `count` keys of one page, rows
// `token_stride` apart from k, kWidth keys at a time: each key row is loaded once for the G heads,
// each head's kWidth dot products finished together. sc: head 0's scores (heads n apart); mx: each
// head's running maximum. pf: the same rows of the next page (nullptr: none), requested meanwhile.
template <typename T, int D, int G>
void page_scores(const float* __restrict qh, const T* __restrict k, int64_t token_stride, int count, float scale,
                 float* __restrict sc, int n, float* __restrict mx, const T* pf) {
  constexpr int W = simd::kWidth, C = D / W;  // C: vectors per head
  vec qv[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) qv[g][c] = simd::mul(simd::load(qh + g * D + c * W), simd::set1(scale));
  alignas(64) vec part[G][W];
  for (int j0 = 0; j0 < count; j0 += W) {
    const int block = std::min(W, count - j0);
    for (int j = 0; j < block; ++j) {
      const T* row = k + (j0 + j) * token_stride;
      if (pf != nullptr) prefetch_row<T, D>(pf + (j0 + j) * token_stride);
      vec kv[C];
      for (int c = 0; c < C; ++c) kv[c] = load_row(row + c * W);
      for (int g = 0; g < G; ++g) {
        vec acc = simd::mul(qv[g][0], kv[0]);
        for (int c = 1; c < C; ++c) acc = simd::fmadd(qv[g][c], kv[c], acc);
        part[g][j] = acc;
      }
    }
    for (int j = block; j < W; ++j)
      for (int g = 0; g < G; ++g) part[g][j] = simd::zero();
    for (int g = 0; g < G; ++g) {
      const vec s = simd::sum_each(part[g]);
      mx[g] = std::max(mx[g], simd::max_first(s, block));
      simd::store_first(sc + static_cast<size_t>(g) * n + j0, s, block);
    }
  }
}

// acc[g] += sum_j p[g][j] v_j over `count` value rows of one page (rows token_stride apart from v), for
// G heads: each value row loaded once for the G heads, the accumulators (fp32, in memory between
// pages) in registers for the page. p: head 0's weights (heads n apart).
template <typename T, int D, int G>
void page_values(const float* __restrict p, int n, const T* __restrict v, int64_t token_stride, int count,
                 float* __restrict acc_out, const T* pf) {
  constexpr int W = simd::kWidth, C = D / W;
  vec acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = simd::load(acc_out + g * D + c * W);
  for (int j = 0; j < count; ++j) {
    const T* row = v + j * token_stride;
    if (pf != nullptr) prefetch_row<T, D>(pf + j * token_stride);
    vec vv[C];
    for (int c = 0; c < C; ++c) vv[c] = load_row(row + c * W);
    for (int g = 0; g < G; ++g) {
      const vec w = simd::set1(p[static_cast<size_t>(g) * n + j]);
      for (int c = 0; c < C; ++c) acc[g][c] = simd::fmadd(w, vv[c], acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) simd::store(acc_out + g * D + c * W, acc[g][c]);
}

// f(std::integral_constant<int, count>) for a runtime count in [1, H]: the head loops above get a
// compile-time trip count, so their queries and accumulators stay in registers.
template <int H, typename F>
inline void with_heads(int count, F&& f) {
  if constexpr (H > 1) {
    if (count < H) {
      with_heads<H - 1>(count, f);
      return;
    }
  }
  f(std::integral_constant<int, H>{});
}

// Whether decode_heads serves this cache type and head size: fp32 or bf16 caches, head_dim a multiple
// of the vector width. AVX-512 keeps heads under 32 channels on its gather kernel
// (decode_head_small_avx512); AVX2 has none, so its row kernel takes every multiple of 8.
template <typename T, int D>
constexpr bool kRowKernel = (std::is_same_v<T, float> || std::is_same_v<T, bf16>) && D > 0 &&
                            D % simd::kWidth == 0 && (simd::kWidth == 8 || D >= 32);

// Decode attention for an fp32 or bf16 cache with head_dim a multiple of the vector width, for KV
// heads [h0, h1) of one row (q, out: their query heads, group per KV head): page by page, each page's
// key rows of every one of those heads are read in one visit, and the next page's requested meanwhile
// (pages lie scattered, so the hardware's prefetcher restarts at each); then the same for the values.
// A pass over the row's pages per KV head instead reads each page's rows with a stride of kv_heads
// heads, which the memory streamed at about half its speed. Query heads go in passes of up to H (the
// registers kept for queries or accumulators).
template <typename T, int D>
void decode_heads(const float* __restrict q, const T* __restrict k_cache, const T* __restrict v_cache,
                  const int32_t* __restrict table, int64_t page_stride, int64_t token_stride, int page_size,
                  int group, int h0, int h1, int start, int len, float scale, float* __restrict out,
                  std::vector<float>& scores) {
  constexpr int H = std::max(1, simd::kAccumulators / (D / simd::kWidth));
  const int n = len - start, heads = (h1 - h0) * group;
  scores.resize(static_cast<size_t>(heads) * (n + 2));
  float* __restrict sc = scores.data();
  float* __restrict m = sc + static_cast<size_t>(heads) * n;  // each query head's maximum score
  float* __restrict inv = m + heads;                          // and 1 / its sum of exponentials
  std::fill(m, m + heads, -FLT_MAX);
  const int last_page = (len - 1) / page_size;
  // f(page's first row of head h0, the next page's or nullptr, tokens, offset of the first in the row)
  auto pages = [&](const T* cache, auto&& f) {
    for (int t0 = start; t0 < len;) {
      const int page = t0 / page_size, in_page = t0 % page_size;
      const int count = std::min(page_size - in_page, len - t0);
      const T* rows = cache + table[page] * page_stride + in_page * token_stride + static_cast<int64_t>(h0) * D;
      const T* next = page < last_page ? cache + table[page + 1] * page_stride + static_cast<int64_t>(h0) * D : nullptr;
      f(rows, next, count, t0 - start);
      t0 += count;
    }
  };
  pages(k_cache, [&](const T* rows, const T* next, int count, int at) {
    for (int h = 0; h < h1 - h0; ++h)
      for (int g0 = 0; g0 < group; g0 += H)
        with_heads<H>(std::min(H, group - g0), [&](auto g) {
          const int r = h * group + g0;
          page_scores<T, D, decltype(g)::value>(q + static_cast<int64_t>(r) * D, rows + h * D, token_stride, count,
                                                scale, sc + static_cast<size_t>(r) * n + at, n, m + r,
                                                next == nullptr ? nullptr : next + h * D);
        });
  });
  softmax_rows(sc, heads, n, m, inv);
  std::fill(out, out + static_cast<int64_t>(heads) * D, 0.0f);
  pages(v_cache, [&](const T* rows, const T* next, int count, int at) {
    for (int h = 0; h < h1 - h0; ++h)
      for (int g0 = 0; g0 < group; g0 += H)
        with_heads<H>(std::min(H, group - g0), [&](auto g) {
          const int r = h * group + g0;
          page_values<T, D, decltype(g)::value>(sc + static_cast<size_t>(r) * n + at, n, rows + h * D, token_stride,
                                                count, out + static_cast<int64_t>(r) * D,
                                                next == nullptr ? nullptr : next + h * D);
        });
  });
  for (int r = 0; r < heads; ++r)
    for (int c = 0; c < D; c += simd::kWidth)
      simd::store(out + r * D + c, simd::mul(simd::load(out + r * D + c), simd::set1(inv[r])));
}
#endif

// Work units of (row, KV heads [h0, h1)): every KV head of a row in one unit when the rows alone keep
// the threads busy (a row's pages are visited once for all its heads), else one KV head each.
template <typename T, int D>
void decode_rows(const float* q, int64_t q_row_stride, const T* k_cache, const T* v_cache, int page_size,
                 int kv_heads, int head_dim, const int32_t* tables, int64_t table_stride,
                 const int32_t* seq_lens, int batch, int q_heads, float scale, int window, float* out,
                 int threads) {
  const int group = q_heads / kv_heads;
  const int64_t token_stride = static_cast<int64_t>(kv_heads) * head_dim;
  const int64_t page_stride = token_stride * page_size;
  const int span = batch >= threads ? kv_heads : 1;  // KV heads per unit
  const int units_per_row = kv_heads / span;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int unit = 0; unit < batch * units_per_row; ++unit) {
    thread_local std::vector<float> scores;
    const int b = unit / units_per_row, h0 = unit % units_per_row * span, h1 = h0 + span;
    const int len = seq_lens[b];
    const int start = window > 0 ? std::max(0, len - window) : 0;
    const float* qb = q + b * q_row_stride;
    float* ob = out + static_cast<int64_t>(b) * q_heads * head_dim;
    if (len <= start) {
      std::fill(ob + static_cast<int64_t>(h0) * group * head_dim, ob + static_cast<int64_t>(h1) * group * head_dim,
                0.0f);
      continue;
    }
#if defined(PIPESERVE_SIMD)
    if constexpr (kRowKernel<T, D>) {
      decode_heads<T, D>(qb + static_cast<int64_t>(h0) * group * head_dim, k_cache, v_cache, tables + b * table_stride,
                         page_stride, token_stride, page_size, group, h0, h1, start, len, scale,
                         ob + static_cast<int64_t>(h0) * group * head_dim, scores);
      continue;
    }
#endif
    for (int h = h0; h < h1; ++h) {
      const float* qh = qb + static_cast<int64_t>(h) * group * head_dim;
      float* oh = ob + static_cast<int64_t>(h) * group * head_dim;
      const T* kh = k_cache + static_cast<int64_t>(h) * head_dim;
      const T* vh = v_cache + static_cast<int64_t>(h) * head_dim;
      if constexpr (D > 0 && D < 32) {
#if defined(PIPESERVE_AVX512)
        if constexpr (std::is_same_v<T, float>) {
          decode_head_small_avx512<D>(qh, kh, vh, tables + b * table_stride, page_stride, token_stride, page_size,
                                      group, start, len, scale, oh, scores);
          continue;
        }
#endif
        decode_head_small<T, D>(qh, kh, vh, tables + b * table_stride, page_stride, token_stride, page_size, group,
                                start, len, scale, oh, scores);
        continue;
      }
      decode_head<T, D>(qh, kh, vh, tables + b * table_stride, page_stride, token_stride, page_size, head_dim, group,
                        start, len, scale, oh, scores);
    }
  }
}

// head_dim as a compile-time constant for the common sizes.
template <typename T>
void decode_any(const float* q, int64_t q_row_stride, const T* k_cache, const T* v_cache, int page_size,
                int kv_heads, int head_dim, const int32_t* tables, int64_t table_stride, const int32_t* seq_lens,
                int batch, int q_heads, float scale, int window, float* out, int threads) {
#define PIPESERVE_DECODE(D)                                                                                   \
  decode_rows<T, D>(q, q_row_stride, k_cache, v_cache, page_size, kv_heads, head_dim, tables, table_stride, \
                    seq_lens, batch, q_heads, scale, window, out, threads)
  switch (head_dim) {
    case 8: PIPESERVE_DECODE(8); break;
    case 16: PIPESERVE_DECODE(16); break;
    case 32: PIPESERVE_DECODE(32); break;
    case 64: PIPESERVE_DECODE(64); break;
    case 128: PIPESERVE_DECODE(128); break;
    default: PIPESERVE_DECODE(0);
  }
#undef PIPESERVE_DECODE
}

template <typename T>
void store_rows(const T* k, const T* v, int64_t k_row_stride, int64_t v_row_stride, T* k_cache, T* v_cache,
                const int64_t* slots, int rows, int64_t row_elems) {
  for (int i = 0; i < rows; ++i) {
    std::memcpy(k_cache + slots[i] * row_elems, k + i * k_row_stride, row_elems * sizeof(T));
    std::memcpy(v_cache + slots[i] * row_elems, v + i * v_row_stride, row_elems * sizeof(T));
  }
}

}  // namespace

// dtype: 0 fp32, 1 bf16, 2 fp16 (the cache's).
extern "C" void pipeserve_decode_attention(int dtype, const float* q, int64_t q_row_stride, const void* k_cache,
                                           const void* v_cache, int page_size, int kv_heads, int head_dim,
                                           const int32_t* tables, int64_t table_stride, const int32_t* seq_lens,
                                           int batch, int q_heads, float scale, int window, float* out,
                                           int threads) {
  switch (dtype) {
    case 0:
      decode_any(q, q_row_stride, static_cast<const float*>(k_cache), static_cast<const float*>(v_cache),
                  page_size, kv_heads, head_dim, tables, table_stride, seq_lens, batch, q_heads, scale, window,
                  out, threads);
      break;
    case 1:
      decode_any(q, q_row_stride, static_cast<const bf16*>(k_cache), static_cast<const bf16*>(v_cache),
                  page_size, kv_heads, head_dim, tables, table_stride, seq_lens, batch, q_heads, scale, window,
                  out, threads);
      break;
    default:
      decode_any(q, q_row_stride, static_cast<const _Float16*>(k_cache), static_cast<const _Float16*>(v_cache),
                  page_size, kv_heads, head_dim, tables, table_stride, seq_lens, batch, q_heads, scale, window,
                  out, threads);
  }
}

// Elements are copied as bytes of their size: 4 (fp32) or 2 (bf16, fp16).
extern "C" void pipeserve_store_kv(int elem_size, const void* k, const void* v, int64_t k_row_stride,
                                   int64_t v_row_stride, void* k_cache, void* v_cache, const int64_t* slots,
                                   int rows, int64_t row_elems) {
  if (elem_size == 4) {
    store_rows(static_cast<const float*>(k), static_cast<const float*>(v), k_row_stride, v_row_stride,
               static_cast<float*>(k_cache), static_cast<float*>(v_cache), slots, rows, row_elems);
  } else {
    store_rows(static_cast<const uint16_t*>(k), static_cast<const uint16_t*>(v), k_row_stride, v_row_stride,
               static_cast<uint16_t*>(k_cache), static_cast<uint16_t*>(v_cache), slots, rows, row_elems);
  }
}
