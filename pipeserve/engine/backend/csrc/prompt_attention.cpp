// Causal self-attention of prompts (whole, or a chunk after their first tokens) in bf16 on AMX tiles,
// for the CPU backend's prefill (fp32 accumulation, bf16 probabilities into the values' product, as a
// bf16 flash kernel does).
//
// torch's CPU flash kernel computes 512 keys a block, so at a 512-token prompt it multiplies the
// whole 512 x 512 score matrix and masks half of it. Here a block of 16 queries stops at the chunk
// of 32 keys that holds its last query: about half the work, on tiles (docs/engine.md has figures).
//
// Everything runs transposed, keys (or channels) down the rows and the block's 16 queries across the
// lanes: the scores S^T = K Q^T, the output O^T = V^T P^T. The online softmax's running max and sum
// per query are then one vector each and every step of it is lane-wise (no horizontal reductions).
// Per KV head the keys are copied once into rows padded to whole chunks and the values laid out once
// as A tiles of V^T (16 channels x 32 keys); per query block its queries become B tiles of Q^T (pairs
// of channels interleaved), and per chunk the probabilities B tiles of P^T (pairs of keys).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx.h"
#include "vec_math.h"

#if defined(PIPESERVE_AMX)
namespace {

constexpr int kQ = 16;     // queries a block: the lanes
constexpr int kKeys = 32;  // keys a chunk: two A tiles of keys, one B tile of probabilities
constexpr int kMaxDim = 256;

// 2^x for x <= 0, 16 lanes: 2^round(x) (vscalefps) times a degree-5 polynomial of 2^f on [-1/2, 1/2],
// ~2e-6 relative (probabilities are rounded to bf16, 4e-3, on their way into the values' product).
// Half the instructions of exp_nonpositive16; the exp is most of the softmax's work (docs/engine.md).
inline __m512 exp2_nonpositive16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.3333558e-3f);  // ln2^5 / 120
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));  // ln2^4 / 24
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));  // ln2^3 / 6
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));  // ln2^2 / 2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));  // ln2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// V [len, row stride v_stride] of one head as [ceil(len / 32) chunks][dim / 16][16 channels][32 keys]:
// chunk c, block n is the A tile of V^T for channels n*16 .. n*16 + 15, zero past len.
void values_transposed(const uint16_t* v, int64_t v_stride, int64_t len, int dim, uint16_t* out) {
  const int64_t chunks = (len + kKeys - 1) / kKeys, blocks = dim / 16;
  for (int64_t c = 0; c < chunks; ++c)
    for (int j = 0; j < kKeys; ++j) {
      const int64_t key = c * kKeys + j;
      const uint16_t* row = v + key * v_stride;
      for (int64_t n = 0; n < blocks; ++n) {
        uint16_t* tile = out + (c * blocks + n) * 512;
        for (int d = 0; d < 16; ++d) tile[d * kKeys + j] = key < len ? row[n * 16 + d] : 0;
      }
    }
}

// Scratch of one thread.
struct alignas(64) Block {
  uint16_t q[kMaxDim / 32 * 512];  // B tiles of Q^T, one per 32 channels
  float scores[kKeys * kQ];        // S^T of a chunk: [key][query]
  uint16_t probs[512];             // B tile of P^T: [16 key pairs][16 queries][2]
  float pv[kMaxDim * kQ];          // V^T P^T of a chunk: [channel][query]
  float out[kMaxDim * kQ];         // O^T: [channel][query]
};

// Q^T of queries first .. first + rows - 1 (rows strided by q_stride) as B tiles: tile c holds
// channels c*32 .. c*32 + 31 as [16 pairs][16 queries][2]; queries past rows are zero.
inline void queries_transposed(const uint16_t* q, int64_t q_stride, int rows, int dim, uint16_t* out) {
  const __m512i offsets = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                             _mm512_set1_epi32(static_cast<int>(q_stride * 2)));
  const __mmask16 valid = pipeserve::lanes(rows);
  for (int p = 0; p < dim / 2; ++p) {  // pair p of channels: a 32-bit word of each query's row
    const __m512i pair = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, offsets, q + 2 * p, 1);
    _mm512_store_si512(out + (p / 16) * 512 + (p % 16) * 32, pair);
  }
}

// Scores S^T [32 keys][16 queries] of keys chunk*32 .. +31 (rows of `keys`, dim apart) against the
// block's Q^T tiles, into s.
inline void scores(const uint16_t* keys, int64_t chunk, int dim, const uint16_t* qt, float* s) {
  _tile_zero(0);
  _tile_zero(1);
  const uint16_t* k0 = keys + chunk * kKeys * dim;
  const uint16_t* k1 = k0 + 16 * dim;
  for (int c = 0; c < dim / 32; ++c) {
    _tile_loadd(6, qt + c * 512, 64);
    _tile_loadd(4, k0 + c * 32, dim * 2);
    _tile_loadd(5, k1 + c * 32, dim * 2);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 5, 6);
  }
  _tile_stored(0, s, 64);
  _tile_stored(1, s + 16 * kQ, 64);
}

// Online softmax over one chunk, lane-wise: query lane q sees keys up to position first + q. Writes
// P^T as a B tile (pairs of keys interleaved, rounded to bf16) and returns alpha, how much each
// query's earlier output and sum shrink under its new max.
inline __m512 softmax_chunk(const float* s, int64_t key0, int64_t first, float scale, __m512& max, __m512& sum,
                            uint16_t* probs) {
  // Scores in base-2 units (scale * log2(e) folded into the one multiply): exp(x - m) = 2^(x' - m').
  const __m512 scale16 = _mm512_set1_ps(scale * 1.44269504088896341f);
  const __m512i query = _mm512_add_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                         _mm512_set1_epi32(static_cast<int>(first - key0)));
  const bool diagonal = key0 + kKeys - 1 > first;  // some keys lie past some queries
  __m512 x[kKeys];
  __m512 top = max;
  for (int j = 0; j < kKeys; ++j) {
    x[j] = _mm512_mul_ps(_mm512_load_ps(s + j * kQ), scale16);
    if (diagonal)
      x[j] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), _mm512_cmpge_epi32_mask(query, _mm512_set1_epi32(j)), x[j]);
    top = _mm512_max_ps(top, x[j]);
  }
  // A lane's first chunk starts from max -inf: alpha ~0 scales an output and a sum that are zero.
  const __m512 alpha = exp2_nonpositive16(_mm512_sub_ps(max, top));
  max = top;
  __m512 total = _mm512_setzero_ps();
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                              23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int j = 0; j < kKeys; j += 2) {
    __m512 p0 = exp2_nonpositive16(_mm512_sub_ps(x[j], top));
    __m512 p1 = exp2_nonpositive16(_mm512_sub_ps(x[j + 1], top));
    if (diagonal) {  // 2^-inf clamps to 2^-126: masked keys count exactly nothing
      p0 = _mm512_maskz_mov_ps(_mm512_cmpge_epi32_mask(query, _mm512_set1_epi32(j)), p0);
      p1 = _mm512_maskz_mov_ps(_mm512_cmpge_epi32_mask(query, _mm512_set1_epi32(j + 1)), p1);
    }
    total = _mm512_add_ps(total, _mm512_add_ps(p0, p1));
    const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(p1, p0));  // p0's 16 then p1's
    _mm512_store_si512(probs + (j / 2) * 32, _mm512_permutexvar_epi16(interleave, both));
  }
  sum = _mm512_fmadd_ps(sum, alpha, total);
  return alpha;
}

// O^T = O^T * alpha + V^T P^T over the chunk's value tiles.
inline void accumulate(Block& b, const uint16_t* value_tiles, int64_t chunk, int dim, __m512 alpha) {
  const int blocks = dim / 16;
  const uint16_t* vt = value_tiles + chunk * blocks * 512;
  _tile_loadd(7, b.probs, 64);
  for (int n = 0; n < blocks; n += 2) {  // dim is a multiple of 32: whole pairs of blocks
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(4, vt + n * 512, 64);
    _tile_loadd(5, vt + (n + 1) * 512, 64);
    _tile_dpbf16ps(0, 4, 7);
    _tile_dpbf16ps(1, 5, 7);
    _tile_stored(0, b.pv + n * 16 * kQ, 64);
    _tile_stored(1, b.pv + (n + 1) * 16 * kQ, 64);
  }
  for (int d = 0; d < dim; ++d)
    _mm512_store_ps(b.out + d * kQ,
                    _mm512_fmadd_ps(_mm512_load_ps(b.out + d * kQ), alpha, _mm512_load_ps(b.pv + d * kQ)));
}

}  // namespace
#endif

// Whether prompt attention runs here for head_dim `dim` (AMX built and granted, dim a multiple of 32
// up to 256).
extern "C" int pipeserve_prompt_attention_supported(int dim) {
#if defined(PIPESERVE_AMX)
  return dim % 32 == 0 && dim > 0 && dim <= kMaxDim && pipeserve::amx::granted();
#else
  (void)dim;
  return 0;
#endif
}

// q [q_len, q_heads, dim], k and v [kv_len, kv_heads, dim] (bf16; rows strided by *_stride elements,
// heads and channels packed), out [q_len, q_heads, dim] (bf16, row stride out_stride): causal
// attention of a prompt's last q_len positions (the whole prompt, or a chunk of it after its first
// kv_len - q_len tokens) over its keys up to each query's own position. Call only where
// pipeserve_prompt_attention_supported(dim).
extern "C" void pipeserve_prompt_attention(const uint16_t* q, int64_t q_stride, const uint16_t* k, int64_t k_stride,
                                           const uint16_t* v, int64_t v_stride, uint16_t* out, int64_t out_stride,
                                           int64_t q_len, int64_t kv_len, int q_heads, int kv_heads, int dim,
                                           float scale, int threads) {
#if defined(PIPESERVE_AMX)
  const int64_t key_chunks = (kv_len + kKeys - 1) / kKeys, padded = key_chunks * kKeys;
  const int64_t head_elems = padded * dim;  // one head's padded keys, or its value tiles
  std::vector<uint16_t> keys(kv_heads * head_elems, 0), value_tiles(kv_heads * head_elems);
#pragma omp parallel for num_threads(threads) if (threads > 1)
  for (int h = 0; h < kv_heads; ++h) {
    for (int64_t t = 0; t < kv_len; ++t)
      std::memcpy(&keys[h * head_elems + t * dim], k + t * k_stride + h * dim, dim * 2);
    values_transposed(v + h * dim, v_stride, kv_len, dim, value_tiles.data() + h * head_elems);
  }
  const int64_t q_blocks = (q_len + kQ - 1) / kQ, group = q_heads / kv_heads;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    pipeserve::amx::configure();
    Block* b = new Block;
#pragma omp for schedule(dynamic)
    for (int64_t task = 0; task < q_heads * q_blocks; ++task) {
      const int h = static_cast<int>(task / q_blocks);
      const int64_t first = (task % q_blocks) * kQ;
      const int rows = static_cast<int>(std::min<int64_t>(kQ, q_len - first));
      const int64_t position = kv_len - q_len + first;  // of the block's first query in the prompt
      const uint16_t* kh = keys.data() + (h / group) * head_elems;
      const uint16_t* vt = value_tiles.data() + (h / group) * head_elems;
      queries_transposed(q + first * q_stride + h * dim, q_stride, rows, dim, b->q);
      std::fill(b->out, b->out + dim * kQ, 0.0f);
      __m512 max = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
      const int64_t last_chunk = (position + rows - 1) / kKeys;  // holds the block's last query
      for (int64_t c = 0; c <= last_chunk; ++c) {
        scores(kh, c, dim, b->q, b->scores);
        const __m512 alpha = softmax_chunk(b->scores, c * kKeys, position, scale, max, sum, b->probs);
        accumulate(*b, vt, c, dim, alpha);
      }
      // O^T / sum, transposed back into the block's output rows.
      const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), sum);
      for (int d = 0; d < dim; ++d)
        _mm512_store_ps(b->out + d * kQ, _mm512_mul_ps(_mm512_load_ps(b->out + d * kQ), inv));
      const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                                _mm512_set1_epi32(kQ));
      for (int r = 0; r < rows; ++r) {
        uint16_t* o = out + (first + r) * out_stride + h * dim;
        for (int d = 0; d < dim; d += 16)
          pipeserve::store_bf16x16(o + d, _mm512_i32gather_ps(column, b->out + d * kQ + r, 4));
      }
    }
    delete b;
    _tile_release();
  }
#else
  (void)q, (void)q_stride, (void)k, (void)k_stride, (void)v, (void)v_stride, (void)out, (void)out_stride;
  (void)q_len, (void)kv_len, (void)q_heads, (void)kv_heads, (void)dim, (void)scale, (void)threads;
#endif
}
