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
//
// LoRA adapters (engine/lora) are added after each of the four products of a layer, for the rows
// whose adapter targets that kind: y_row += (x_row A[slot]) B[slot], read from the slot table's own
// tensors (their dtype is the weights'), fp32 accumulation. Rows of one slot run together, so a
// slot's factors are read once per block of rows, not once per row.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "scratch.h"
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
// The LoRA slot tables come last: A [slots, in, n] and B [slots, n, out] per kind (0: no table there).
enum LayerField {
  kInputNorm, kQkv, kQkvBias, kO, kPostNorm, kGateUp, kDown, kKCache, kVCache, kWindow,
  kLoraQkvA, kLoraQkvB, kLoraOA, kLoraOB, kLoraGateUpA, kLoraGateUpB, kLoraDownA, kLoraDownB, kLayerFields
};
// The linear kinds of a layer an adapter may target, as bits of a slot's kind mask (lora/layout.py's
// KINDS order), and how many sub-projections each stacks (q/k/v, o, gate/up, down).
enum LoraKind { kLoraQkv, kLoraO, kLoraGateUp, kLoraDown };
constexpr int kLoraSubs[] = {3, 1, 2, 1};
// The model's sizes, in the same order as native_step.py's DIMS.
// kWeightDtype: 0 fp32 (packed and embedding), 1 bf16; kCacheDtype: 0 fp32, 1 bf16.
// kLoraRank: the slot table's rank R (a kind of n sub-projections is n * R wide; 0: no adapters),
// kLoraSlots: its slots.
enum Dim {
  kHidden, kQHeads, kKvHeads, kHeadDim, kInter, kLayers, kRotDim, kPageSize, kWeightDtype, kCacheDtype,
  kLoraRank, kLoraSlots, kDims
};

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

inline float load(float w) { return w; }
inline float load(uint16_t w) { return pipeserve::bf16_to_float(w); }

// The step's LoRA rows: those with an adapter, ordered by slot (counting sort), cut into blocks of
// up to kLoraBlock rows of one slot: the unit of work (each writes its own rows: no two threads meet).
constexpr int kLoraBlock = 4;
constexpr int kLoraTile = 64;  // output columns an expand keeps in registers per row

struct LoraBlock {
  int32_t slot, begin, end;  // rows order[begin .. end)
};

struct LoraRows {
  std::vector<int32_t> order;
  std::vector<LoraBlock> blocks;

  void build(const int32_t* row_slots, int rows, int64_t slots) {
    order.clear();
    blocks.clear();
    std::vector<int32_t> start(slots + 1, 0);
    for (int r = 0; r < rows; ++r)
      if (row_slots[r] >= 0) ++start[row_slots[r] + 1];
    for (int64_t s = 0; s < slots; ++s) start[s + 1] += start[s];
    order.resize(start[slots]);
    std::vector<int32_t> next(start.begin(), start.end() - 1);
    for (int r = 0; r < rows; ++r)
      if (row_slots[r] >= 0) order[next[row_slots[r]]++] = r;
    for (int64_t s = 0; s < slots; ++s)
      for (int32_t b = start[s]; b < start[s + 1]; b += kLoraBlock)
        blocks.push_back({static_cast<int32_t>(s), b, std::min(b + kLoraBlock, start[s + 1])});
  }
};

// y[r] += (x[r] A) B for the C rows of one block (C <= kLoraBlock), A [in, n] and B [n, out] one
// slot's factors. Both products keep their accumulators in registers: the shrink takes up to 48
// columns of A per pass, the expand kLoraTile output columns, for every row at once, so each element
// of A and B is loaded once per block. A slot's factors come from memory (the base weights stream
// through the caches between layers), so the next block's, at next_a / next_b (same shapes; null:
// none), are requested line by line as the same offsets of this block's are read.
template <typename T>
inline void prefetch(const T* p, int count) {
  constexpr int per_line = 64 / sizeof(T);
  for (int k = 0; k < count; k += per_line) __builtin_prefetch(p + k, 0, 2);
}

template <int C, int W, typename T>
inline void shrink_cols(const float* const* xs, const T* __restrict a, int64_t in, int64_t n, int64_t j0,
                        float* t, const T* next_a) {
  float acc[C][W] = {};
  for (int64_t i = 0; i < in; ++i) {
    if (next_a != nullptr) prefetch(next_a + i * n + j0, W);
    const T* __restrict ai = a + i * n + j0;
    for (int c = 0; c < C; ++c) {
      const float xi = xs[c][i];
#pragma omp simd
      for (int l = 0; l < W; ++l) acc[c][l] += xi * load(ai[l]);
    }
  }
  for (int c = 0; c < C; ++c)
    for (int l = 0; l < W; ++l) t[c * n + j0 + l] = acc[c][l];
}

template <int C, int W, typename T>
inline void expand_cols(const float* t, int64_t n, const T* __restrict b, int64_t out, int64_t o0,
                        float* const* ys, const T* next_b) {
  float acc[C][W];
  for (int c = 0; c < C; ++c)
    for (int l = 0; l < W; ++l) acc[c][l] = ys[c][o0 + l];
  for (int64_t j = 0; j < n; ++j) {
    if (next_b != nullptr) prefetch(next_b + j * out + o0, W);
    bool zero = true;  // ranks below the table's, sub-projections the adapter leaves alone
    for (int c = 0; c < C; ++c) zero = zero && t[c * n + j] == 0.0f;
    if (zero) continue;
    const T* __restrict bj = b + j * out + o0;
    for (int c = 0; c < C; ++c) {
      const float tj = t[c * n + j];
#pragma omp simd
      for (int l = 0; l < W; ++l) acc[c][l] += tj * load(bj[l]);
    }
  }
  for (int c = 0; c < C; ++c)
    for (int l = 0; l < W; ++l) ys[c][o0 + l] = acc[c][l];
}

template <int C, typename T>
void lora_rows(const float* const* xs, const T* a, const T* b, float* const* ys, int64_t in, int64_t n,
               int64_t out, float* t, const T* next_a, const T* next_b) {
  // Up to 48 columns a pass (a fused qkv of rank 16): most shapes read A once, as it lies.
  int64_t j = 0;
  for (; j + 48 <= n; j += 48) shrink_cols<C, 48>(xs, a, in, n, j, t, next_a);
  if (n - j >= 32) {
    shrink_cols<C, 32>(xs, a, in, n, j, t, next_a);
    j += 32;
  }
  if (n - j >= 24) {
    shrink_cols<C, 24>(xs, a, in, n, j, t, next_a);
    j += 24;
  }
  if (n - j >= 16) {
    shrink_cols<C, 16>(xs, a, in, n, j, t, next_a);
    j += 16;
  }
  for (; j + 8 <= n; j += 8) shrink_cols<C, 8>(xs, a, in, n, j, t, next_a);
  for (; j < n; ++j) shrink_cols<C, 1>(xs, a, in, n, j, t, next_a);
  int64_t o = 0;
  for (; o + kLoraTile <= out; o += kLoraTile) expand_cols<C, kLoraTile>(t, n, b, out, o, ys, next_b);
  for (; o + 16 <= out; o += 16) expand_cols<C, 16>(t, n, b, out, o, ys, next_b);
  for (; o < out; ++o) expand_cols<C, 1>(t, n, b, out, o, ys, next_b);
}

template <typename T>
void lora_block(const float* x, int64_t x_stride, const T* a, const T* b, float* y, int64_t y_stride,
                const int32_t* rows, int count, int64_t in, int64_t n, int64_t out, const T* next_a,
                const T* next_b) {
  static thread_local std::vector<float> scratch;
  if (static_cast<int64_t>(scratch.size()) < kLoraBlock * n) scratch.resize(kLoraBlock * n);
  const float* xs[kLoraBlock];
  float* ys[kLoraBlock];
  for (int c = 0; c < count; ++c) {
    xs[c] = x + rows[c] * x_stride;
    ys[c] = y + rows[c] * y_stride;
  }
  float* t = scratch.data();  // [count, n] the shrunk rows
  switch (count) {
    case 1: lora_rows<1>(xs, a, b, ys, in, n, out, t, next_a, next_b); break;
    case 2: lora_rows<2>(xs, a, b, ys, in, n, out, t, next_a, next_b); break;
    case 3: lora_rows<3>(xs, a, b, ys, in, n, out, t, next_a, next_b); break;
    default: lora_rows<4>(xs, a, b, ys, in, n, out, t, next_a, next_b); break;
  }
}

// One block against slot `slot` of the tables a [S, in, n] and b [S, n, out]; next: the slot whose
// factors to fetch meanwhile (-1: none).
template <typename T>
void run_block(const T* a, const T* b, const float* x, int64_t x_stride, float* y, int64_t y_stride,
               const int32_t* rows, int count, int64_t in, int64_t n, int64_t out, int64_t slot, int64_t next) {
  lora_block(x, x_stride, a + slot * in * n, b + slot * n * out, y, y_stride, rows, count, in, n, out,
             next < 0 ? nullptr : a + next * in * n, next < 0 ? nullptr : b + next * n * out);
}

// The adapters' deltas of one linear kind of a layer into y, for the blocks whose slot targets it.
void add_lora(bool bf16, const int64_t* layer, LoraKind kind, int64_t rank, const LoraRows& lora,
              const int32_t* slot_kinds, const float* x, int64_t x_stride, float* y, int64_t y_stride,
              int64_t in, int64_t out, int threads) {
  const int64_t a_addr = layer[kLoraQkvA + 2 * kind], b_addr = layer[kLoraQkvB + 2 * kind];
  if (a_addr == 0 || b_addr == 0) return;
  const int64_t n = kLoraSubs[kind] * rank;
  const int64_t blocks = static_cast<int64_t>(lora.blocks.size());
#pragma omp parallel for num_threads(threads) schedule(dynamic) if (threads > 1 && blocks > 1)
  for (int64_t k = 0; k < blocks; ++k) {
    const LoraBlock& blk = lora.blocks[k];
    if (!(slot_kinds[blk.slot] >> kind & 1)) continue;
    const int32_t* rows = lora.order.data() + blk.begin;
    const int count = blk.end - blk.begin;
    // The next block's slot, when it is another one this kind applies to: its factors are fetched
    // meanwhile.
    int64_t next = -1;
    if (k + 1 < blocks) {
      const int32_t s = lora.blocks[k + 1].slot;
      if (s != blk.slot && (slot_kinds[s] >> kind & 1)) next = s;
    }
    if (bf16)
      run_block(reinterpret_cast<const uint16_t*>(a_addr), reinterpret_cast<const uint16_t*>(b_addr), x, x_stride, y,
                y_stride, rows, count, in, n, out, blk.slot, next);
    else
      run_block(reinterpret_cast<const float*>(a_addr), reinterpret_cast<const float*>(b_addr), x, x_stride, y,
                y_stride, rows, count, in, n, out, blk.slot, next);
  }
}

}  // namespace

// rows decode rows: token ids, positions, KV slots, block tables [rows, table_stride] and sequence
// lengths (position + 1; a verification chunk's rows share a table and attend causally by length).
// layers: dims[kLayers] rows of kLayerFields; rope_table [positions, rot_dim]; out [rows, hidden]
// gets the final norm's output and, with lm_head (packed, vocab outputs), logits [rows, vocab] the
// head's. lora_slots: each row's adapter slot (-1: none; null: no row has one) and lora_kinds each
// slot's kind mask (bits of LoraKind). Threads split each product, the attention and the adapters.
extern "C" void pipeserve_decode_step(const int64_t* dims, float eps, float scale, const int64_t* layers,
                                      const void* embed, const float* final_norm, const float* rope_table,
                                      const void* lm_head, int64_t vocab, const int64_t* ids,
                                      const int64_t* positions, const int64_t* slots, const int32_t* tables,
                                      int64_t table_stride, const int32_t* seq_lens, int rows,
                                      const int32_t* lora_slots, const int32_t* lora_kinds, float* out,
                                      float* logits, int threads) {
  const int64_t hidden = dims[kHidden], inter = dims[kInter], head_dim = dims[kHeadDim];
  const int q_heads = static_cast<int>(dims[kQHeads]), kv_heads = static_cast<int>(dims[kKvHeads]);
  const int64_t q_size = q_heads * head_dim, kv_size = kv_heads * head_dim, qkv_size = q_size + 2 * kv_size;
  const int rot_dim = static_cast<int>(dims[kRotDim]), page_size = static_cast<int>(dims[kPageSize]);
  const bool bf16 = dims[kWeightDtype] == 1, bf16_cache = dims[kCacheDtype] == 1;

  // The step's activations, one after another: each starts on a cache line where the row sizes are
  // multiples of 16 floats (one engine thread calls this).
  static thread_local pipeserve::Scratch scratch;
  // (+ kv_size: a row's K and V in bf16 for a bf16 cache, two to a float)
  const int64_t per_row = hidden * 3 + qkv_size + q_size + 2 * inter + inter + kv_size;
  float* resid = scratch.hold<float>(per_row * rows);  // [rows, hidden] the residual stream
  float* normed = resid + rows * hidden;  // [rows, hidden] its norm: a sublayer's input
  float* sub = normed + rows * hidden;    // [rows, hidden] a sublayer's output
  float* qkv = sub + rows * hidden;       // [rows, qkv_size]
  float* attn = qkv + rows * qkv_size;    // [rows, q_size]
  float* gate_up = attn + rows * q_size;  // [rows, 2 * inter]
  float* act = gate_up + rows * 2 * inter;
  uint16_t* kv16 = reinterpret_cast<uint16_t*>(act + rows * inter);  // [rows, 2, kv_size] bf16

  static thread_local LoraRows lora;
  const int64_t rank = dims[kLoraRank];
  const bool adapters = lora_slots != nullptr && rank > 0;
  if (adapters) lora.build(lora_slots, rows, dims[kLoraSlots]);
  // The adapters of one kind, where some row has one: x [rows, in] -> y [rows, out] (strides in, out).
  auto adapt = [&](const int64_t* layer, LoraKind kind, const float* x, float* y, int64_t in, int64_t out_size) {
    if (adapters)
      add_lora(bf16, layer, kind, rank, lora, lora_kinds, x, in, y, out_size, in, out_size, threads);
  };

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
    adapt(layer, kLoraQkv, normed, qkv, hidden, qkv_size);
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
    adapt(layer, kLoraO, attn, sub, q_size, hidden);
    add_norm(resid, sub, field<const float>(layer, kPostNorm), eps, normed, rows, hidden);
    linear(bf16, normed, hidden, field<const void>(layer, kGateUp), nullptr, gate_up, rows, 2 * inter, hidden,
           threads);
    adapt(layer, kLoraGateUp, normed, gate_up, hidden, 2 * inter);
    silu_and_mul(gate_up, act, rows, inter);
    linear(bf16, act, inter, field<const void>(layer, kDown), nullptr, sub, rows, hidden, inter, threads);
    adapt(layer, kLoraDown, act, sub, inter, hidden);
    sublayer = sub;
  }
  add_norm(resid, sublayer, final_norm, eps, out, rows, hidden);
  if (lm_head != nullptr) linear(bf16, out, hidden, lm_head, nullptr, logits, rows, vocab, hidden, threads);
}
