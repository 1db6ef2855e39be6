// A whole decode step of a dense Llama-family model (Llama, Mistral, Qwen2) with fp32 or bf16 weights
// (and an fp32 or bf16 cache), in one call:
// embedding, every layer (norms, fused qkv with its bias, rotary embedding, the paged KV store,
// decode attention, o, gate/up, SiLU-and-mul, down) and the final norm, for any number of rows
// (each a query at its own position: decode, verification or prefill rows), and the logits when
// native_step.py passes a packed LM head (an untied head, or a packed copy of a small tied one).
//
// At batch 1 the products are most of the step; what a per-op forward pass adds around them (one
// dispatch per op, each through Python) is what this removes. The kernels are the ones the per-op
// path calls: the packed product (packed_gemm.cpp) and the KV store and decode attention
// (paged_attention.cpp); the glue between them is here. Activations stay fp32 between the products
// whatever the weights' dtype (a bf16 product rounds its input rows to bf16); norm weights, biases
// and the rotary table come as fp32.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec_math.h"

extern "C" void pipeserve_packed_linear(const float* x, int64_t x_stride, const float* packed, const float* bias,
                                        float* y, int64_t m_rows, int64_t n, int64_t k_len, int threads);
extern "C" void pipeserve_packed_linear_bf16(const float* x, int64_t x_stride, const uint16_t* packed,
                                             const float* bias, float* y, int64_t m_rows, int64_t n, int64_t k_len,
                                             int threads);
extern "C" void pipeserve_store_kv(int elem_size, const void* k, const void* v, int64_t k_row_stride,
                                   int64_t v_row_stride, void* k_cache, void* v_cache, const int64_t* slots,
                                   int rows, int64_t row_elems);
extern "C" void pipeserve_decode_attention(int dtype, const float* q, int64_t q_row_stride, const void* k_cache,
                                           const void* v_cache, int page_size, int kv_heads, int head_dim,
                                           const int32_t* tables, int64_t table_stride, const int32_t* seq_lens,
                                           int batch, int q_heads, float scale, int window, float* out,
                                           int threads);

namespace {

// One layer's addresses, as native_step.py lays them out (an int64 each; 0: absent).
enum LayerField {
  kInputNorm, kQkv, kQkvBias, kO, kPostNorm, kGateUp, kDown, kKCache, kVCache, kWindow, kLayerFields
};
// The model's sizes, in the same order as native_step.py's DIMS.
// kWeightDtype: 0 fp32 (packed and embedding), 1 bf16; kCacheDtype: 0 fp32, 1 bf16.
enum Dim { kHidden, kQHeads, kKvHeads, kHeadDim, kInter, kLayers, kRotDim, kPageSize, kWeightDtype, kCacheDtype, kDims };

template <typename T>
inline T* field(const int64_t* layer, LayerField f) {
  return reinterpret_cast<T*>(layer[f]);
}

using pipeserve::rms_norm;
using pipeserve::rope;

// resid += add (when add is set), then out = rms_norm(resid): the pre-norm of the next sublayer.
void add_norm(float* __restrict resid, const float* __restrict add, const float* w, float eps,
              float* __restrict out, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) {
    float* x = resid + r * n;
    if (add != nullptr) {
      const float* a = add + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) x[i] += a[i];
    }
    rms_norm(x, w, eps, out + r * n, n);
  }
}

// out[r] = silu(gate) * up for rows [gate | up] of 2 * inter.
void silu_and_mul(const float* __restrict gate_up, float* __restrict out, int64_t rows, int64_t inter) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gate_up + r * 2 * inter;
    pipeserve::silu_mul(g, g + inter, out + r * inter, inter);
  }
}

// y = x w^T (+ bias) through the packed product of the weights' dtype.
inline void linear(bool bf16, const float* x, int64_t x_stride, const void* packed, const float* bias, float* y,
                   int64_t m_rows, int64_t n, int64_t k_len, int threads) {
  if (bf16)
    pipeserve_packed_linear_bf16(x, x_stride, static_cast<const uint16_t*>(packed), bias, y, m_rows, n, k_len,
                                 threads);
  else
    pipeserve_packed_linear(x, x_stride, static_cast<const float*>(packed), bias, y, m_rows, n, k_len, threads);
}

}  // namespace

// rows decode rows: token ids, positions, KV slots, block tables [rows, table_stride] and sequence
// lengths (position + 1; a verification chunk's rows share a table and attend causally by length).
// layers: dims[kLayers] rows of kLayerFields; rope_table [positions, rot_dim]; out [rows, hidden]
// gets the final norm's output and, with lm_head (packed, vocab outputs), logits [rows, vocab] the
// head's. Threads split each product and the attention.
extern "C" void pipeserve_decode_step(const int64_t* dims, float eps, float scale, const int64_t* layers,
                                      const void* embed, const float* final_norm, const float* rope_table,
                                      const void* lm_head, int64_t vocab, const int64_t* ids,
                                      const int64_t* positions, const int64_t* slots, const int32_t* tables,
                                      int64_t table_stride, const int32_t* seq_lens, int rows, float* out,
                                      float* logits, int threads) {
  const int64_t hidden = dims[kHidden], inter = dims[kInter], head_dim = dims[kHeadDim];
  const int q_heads = static_cast<int>(dims[kQHeads]), kv_heads = static_cast<int>(dims[kKvHeads]);
  const int64_t q_size = q_heads * head_dim, kv_size = kv_heads * head_dim, qkv_size = q_size + 2 * kv_size;
  const int rot_dim = static_cast<int>(dims[kRotDim]), page_size = static_cast<int>(dims[kPageSize]);
  const bool bf16 = dims[kWeightDtype] == 1, bf16_cache = dims[kCacheDtype] == 1;

  // Scratch grows to the largest step seen and is reused after (one engine thread calls this).
  static thread_local std::vector<float> scratch;
  // (+ kv_size: a row's K and V in bf16 for a bf16 cache, two to a float)
  const int64_t per_row = hidden * 3 + qkv_size + q_size + 2 * inter + inter + kv_size;
  if (static_cast<int64_t>(scratch.size()) < per_row * rows) scratch.resize(per_row * rows);
  float* resid = scratch.data();          // [rows, hidden] the residual stream
  float* normed = resid + rows * hidden;  // [rows, hidden] its norm: a sublayer's input
  float* sub = normed + rows * hidden;    // [rows, hidden] a sublayer's output
  float* qkv = sub + rows * hidden;       // [rows, qkv_size]
  float* attn = qkv + rows * qkv_size;    // [rows, q_size]
  float* gate_up = attn + rows * q_size;  // [rows, 2 * inter]
  float* act = gate_up + rows * 2 * inter;
  uint16_t* kv16 = reinterpret_cast<uint16_t*>(act + rows * inter);  // [rows, 2, kv_size] bf16

  for (int r = 0; r < rows; ++r) {
    if (bf16) {
      const uint16_t* e = static_cast<const uint16_t*>(embed) + ids[r] * hidden;
      for (int64_t i = 0; i < hidden; ++i) resid[r * hidden + i] = pipeserve::bf16_to_float(e[i]);
    } else {
      std::copy_n(static_cast<const float*>(embed) + ids[r] * hidden, hidden, resid + r * hidden);
    }
  }
  const float* sublayer = nullptr;  // the previous sublayer's output, not yet added to resid
  for (int64_t l = 0; l < dims[kLayers]; ++l) {
    const int64_t* layer = layers + l * kLayerFields;
    add_norm(resid, sublayer, field<const float>(layer, kInputNorm), eps, normed, rows, hidden);
    linear(bf16, normed, hidden, field<const void>(layer, kQkv), field<const float>(layer, kQkvBias), qkv, rows,
           qkv_size, hidden, threads);
    // q's heads and then k's lie back to back: one pass over both.
    for (int r = 0; r < rows; ++r)
      rope(qkv + r * qkv_size, q_heads + kv_heads, static_cast<int>(head_dim), rope_table + positions[r] * rot_dim,
           rot_dim);
    void* k_cache = field<void>(layer, kKCache);
    void* v_cache = field<void>(layer, kVCache);
    if (bf16_cache) {
      for (int r = 0; r < rows; ++r) {
        const float* kv = qkv + r * qkv_size + q_size;
        uint16_t* out16 = kv16 + r * 2 * kv_size;
#pragma omp simd
        for (int64_t i = 0; i < 2 * kv_size; ++i) out16[i] = pipeserve::float_to_bf16(kv[i]);
      }
      pipeserve_store_kv(2, kv16, kv16 + kv_size, 2 * kv_size, 2 * kv_size, k_cache, v_cache, slots, rows, kv_size);
    } else {
      pipeserve_store_kv(4, qkv + q_size, qkv + q_size + kv_size, qkv_size, qkv_size, k_cache, v_cache, slots, rows,
                         kv_size);
    }
    pipeserve_decode_attention(bf16_cache ? 1 : 0, qkv, qkv_size, k_cache, v_cache, page_size, kv_heads, static_cast<int>(head_dim),
                               tables, table_stride, seq_lens, rows, q_heads, scale,
                               static_cast<int>(layer[kWindow]), attn, threads);
    linear(bf16, attn, q_size, field<const void>(layer, kO), nullptr, sub, rows, hidden, q_size, threads);
    add_norm(resid, sub, field<const float>(layer, kPostNorm), eps, normed, rows, hidden);
    linear(bf16, normed, hidden, field<const void>(layer, kGateUp), nullptr, gate_up, rows, 2 * inter, hidden,
           threads);
    silu_and_mul(gate_up, act, rows, inter);
    linear(bf16, act, inter, field<const void>(layer, kDown), nullptr, sub, rows, hidden, inter, threads);
    sublayer = sub;
  }
  add_norm(resid, sublayer, final_norm, eps, out, rows, hidden);
  if (lm_head != nullptr) linear(bf16, out, hidden, lm_head, nullptr, logits, rows, vocab, hidden, threads);
}
