// Row-wise float kernels for the per-op path's many-row steps (prefill chunks, which the native step
// leaves to the per-op forward pass): RMSNorm after a residual add, SiLU-and-mul and rotate-half RoPE,
// the native step's own code (vec_math.h), each row once, the rows split over `threads`. In torch the
// same work is several passes over the rows: the add, the square, the mean, the scale and the weight;
// SiLU then the product; RoPE's two halves, their concatenation, two products and the sum.
#include <cstdint>

#include "vec_math.h"

// out[r] = rms_norm(x[r] (+ add[r])) * w; with add, resid[r] = x[r] + add[r] (the new residual stream).
// Rows of x and add strided; out and resid [rows, n] contiguous.
extern "C" void pipeserve_rms_norm_rows(const float* x, int64_t x_stride, const float* add, int64_t add_stride,
                                        const float* w, float eps, float* out, float* resid, int64_t rows,
                                        int64_t n, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * x_stride;
    if (add != nullptr) {
      const float* a = add + r * add_stride;
      float* s = resid + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) s[i] = xr[i] + a[i];
      xr = s;
    }
    pipeserve::rms_norm(xr, w, eps, out + r * n, n);
  }
}

// out[r] = silu(gate) * up for rows [gate | up] (2 * inter floats, rows `stride` apart).
extern "C" void pipeserve_silu_and_mul_rows(const float* gate_up, int64_t stride, float* out, int64_t rows,
                                            int64_t inter, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gate_up + r * stride;
    pipeserve::silu_mul(g, g + inter, out + r * inter, inter);
  }
}

// Rotates `heads` heads of head_dim at each row of x (rows `row_stride` apart, heads packed) in place,
// row r at positions[r] of the table [positions, table_stride] (cos then sin, rot_dim together).
extern "C" void pipeserve_rope_rows(float* x, int64_t row_stride, int heads, int head_dim, const float* table,
                                    int64_t table_stride, const int64_t* positions, int64_t rows, int rot_dim,
                                    int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t r = 0; r < rows; ++r)
    pipeserve::rope(x + r * row_stride, heads, head_dim, table + positions[r] * table_stride, rot_dim);
}
