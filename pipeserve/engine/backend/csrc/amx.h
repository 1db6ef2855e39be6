// AMX tiles for the kernels that multiply bf16 on them (packed_gemm.cpp, prompt_attention.cpp):
// Linux's permission and the one tile shape they all use (included, not compiled on its own).
#pragma once

#include "vec_math.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(PIPESERVE_AVX512) && \
    defined(__linux__)
#define PIPESERVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace pipeserve::amx {

// Linux hands out the tile registers' 8 KB of state only to processes that ask (arch_prctl); once
// per process. False: no AMX here (an old kernel, or a VM that withholds it): callers take another
// path.
inline bool granted() {
  static const bool ok = [] {
    constexpr int kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ok;
}

struct alignas(64) Config {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// All eight tiles 16 rows x 64 bytes: an A tile is 16 rows of 32 bf16, a B tile 16 pairs of rows of
// 16 columns (the pairs interleaved), a C tile 16 x 16 fp32. Per thread, before its first tile op.
inline void configure() {
  Config cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}

}  // namespace pipeserve::amx
#endif
