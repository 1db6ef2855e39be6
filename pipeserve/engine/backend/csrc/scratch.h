// Per-thread scratch for the kernels' intermediates (packed_gemm.cpp's bf16 rows, decode_step.cpp's
// activations): grows to the largest request seen and is reused, 2 MB aligned on transparent huge
// pages, as the packed weights are (included, not compiled on its own). From malloc a buffer sat 16
// bytes past a line: every 64-byte row a tile loads or stores then spanned two cache lines, and AMX
// products of 64-128 rows ran slower (docs/engine.md).
#pragma once

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <cstddef>
#include <cstdlib>
#include <new>

namespace pipeserve {

class Scratch {
 public:
  Scratch() = default;
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() { std::free(data_); }

  // Room for count values of T; what it held before is not kept when it grows.
  template <typename T>
  T* hold(size_t count) {
    const size_t bytes = count * sizeof(T);
    if (bytes > bytes_) {
      constexpr size_t kHuge = size_t{2} << 20;
      std::free(data_);
      bytes_ = (bytes + kHuge - 1) / kHuge * kHuge;
      data_ = std::aligned_alloc(kHuge, bytes_);
      if (data_ == nullptr) {
        bytes_ = 0;
        throw std::bad_alloc();
      }
#if defined(MADV_HUGEPAGE)
      madvise(data_, bytes_, MADV_HUGEPAGE);
#endif
    }
    return static_cast<T*>(data_);
  }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace pipeserve
