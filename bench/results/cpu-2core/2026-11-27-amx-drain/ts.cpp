#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <algorithm>
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
struct alignas(64) Cfg { uint8_t p = 1, s = 0; uint8_t r[14] = {}; uint16_t c[16] = {}; uint8_t rows[16] = {}; };
alignas(64) char bbuf[160 * 1024];
alignas(64) char abuf[64 * 1024];
alignas(64) float out[4][16][16];
alignas(64) float y[64][1280];
template <int MODE>
double run(int passes, int chunks) {
  double t0 = now();
  for (int p = 0; p < passes; ++p) {
    if (MODE == 3) { _tile_loadd(0, y[0], 0); _tile_loadd(1, y[0], 0); _tile_loadd(2, y[0], 0); _tile_loadd(3, y[0], 0); }
    else { _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3); }
    for (int c = 0; c < chunks; ++c) {
      _tile_loadd(6, bbuf + c * 1024, 64); _tile_loadd(7, bbuf + 65536 + c * 1024, 64);
      _tile_loadd(4, abuf + c * 64, 1600); _tile_loadd(5, abuf + 16 * 1600 + c * 64, 1600);
      _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
    }
    if (MODE == 1) { _tile_stored(0, out[0], 64); _tile_stored(1, out[1], 64); _tile_stored(2, out[2], 64); _tile_stored(3, out[3], 64); }
    if (MODE >= 2) { int o = (p % 40) * 32; _tile_stored(0, &y[0][o], 5120); _tile_stored(1, &y[0][o + 16], 5120); _tile_stored(2, &y[16][o], 5120); _tile_stored(3, &y[16][o + 16], 5120); }
  }
  return (now() - t0) / passes * 3.4e9;  // cycles at 3.4 GHz
}
// 1 row block x 2 panels, C tile sets alternating per pass (C0/C1, C2/C3), A alternating 4/5
template <int STORE>
double run1x2(int passes, int chunks) {
  double t0 = now();
  for (int p = 0; p < passes; p += 2) {
    int o = (p % 40) * 16;
    _tile_zero(0); _tile_zero(1);
    for (int c = 0; c < chunks; ++c) {
      _tile_loadd(6, bbuf + c * 1024, 64); _tile_loadd(7, bbuf + 65536 + c * 1024, 64);
      _tile_loadd(4, abuf + c * 64, 1600);
      _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
    }
    if (STORE) { _tile_stored(0, &y[0][o], 5120); _tile_stored(1, &y[0][o + 16], 5120); }
    _tile_zero(2); _tile_zero(3);
    for (int c = 0; c < chunks; ++c) {
      _tile_loadd(6, bbuf + c * 1024, 64); _tile_loadd(7, bbuf + 65536 + c * 1024, 64);
      _tile_loadd(5, abuf + 16 * 1600 + c * 64, 1600);
      _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
    }
    if (STORE) { _tile_stored(2, &y[16][o], 5120); _tile_stored(3, &y[16][o + 16], 5120); }
  }
  return (now() - t0) / passes * 2 * 3.4e9;  // cycles per 32 rows x 32 cols, like run()
}
int main() {
  syscall(SYS_arch_prctl, 0x1023, 18);
  Cfg cfg; for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.c[t] = 64; _tile_loadconfig(&cfg);
  memset(bbuf, 0, sizeof bbuf); memset(abuf, 0, sizeof abuf); memset(y, 0, sizeof y);
  for (int chunks : {24, 64}) {
    double best[6] = {1e9, 1e9, 1e9, 1e9, 1e9, 1e9};
    for (int r = 0; r < 20; ++r) {
      double v[6] = {run<0>(2000, chunks), run<1>(2000, chunks), run<2>(2000, chunks), run<3>(2000, chunks), run1x2<0>(2000, chunks), run1x2<1>(2000, chunks)};
      for (int i = 0; i < 6; ++i) best[i] = std::min(best[i], v[i]);
    }
    printf("  1x2 alternating sets: no store %.0f, store y %.0f\n", best[4], best[5]);
    printf("chunks %d: cycles/pass (3.4 GHz) none %.0f  store L1 %.0f  store y %.0f  store y + bias-load start %.0f  (pure tdp %d)\n", chunks, best[0], best[1], best[2], best[3], chunks * 4 * 16);
  }
}
