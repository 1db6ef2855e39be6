// stream: GB/s of reading a 64 MB buffer of "panel pairs" (K=768: 48 KB a pair) in ways
#include <immintrin.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <algorithm>
#include <vector>
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
struct alignas(64) Cfg { uint8_t p = 1, s = 0; uint8_t r[14] = {}; uint16_t c[16] = {}; uint8_t rows[16] = {}; };
const int64_t PANEL = 16 * 768 * 2;  // bytes of one panel (K=768)
const int64_t CH = 1024;            // one B tile
int64_t TOTAL = 64 << 20;
char* buf;
const int64_t XS = (384 + 16) * 4; char* xa;
float sink;
template <int MODE, int AHEAD_T1>
double run(int reps) {
  double t0 = now();
  __m512 acc = _mm512_setzero_ps();
  for (int r = 0; r < reps; ++r)
    for (int64_t pp = 0; pp < TOTAL; pp += 2 * PANEL) {
      const char* p0 = buf + pp; const char* p1 = p0 + PANEL;
      for (int64_t c = 0; c < PANEL; c += CH) {
        if (MODE >= 1)
          for (int l = 0; l < CH; l += 64) { _mm_prefetch(p0 + c + 2 * CH + l, _MM_HINT_T0); _mm_prefetch(p1 + c + 2 * CH + l, _MM_HINT_T0); }
        if (AHEAD_T1)
          for (int l = 0; l < CH; l += 64) { _mm_prefetch(p0 + c + AHEAD_T1 * CH + l, _MM_HINT_T1); _mm_prefetch(p1 + c + AHEAD_T1 * CH + l, _MM_HINT_T1); }
        if (MODE == 3) {  // plain loads
          for (int l = 0; l < CH; l += 64) { acc = _mm512_add_ps(acc, _mm512_load_ps(p0 + c + l)); acc = _mm512_add_ps(acc, _mm512_load_ps(p1 + c + l)); }
        } else {
          _tile_loadd(6, p0 + c, 64);
          _tile_loadd(7, p1 + c, 64);
          if (MODE == 4) { _tile_loadd(4, xa + c / 16, XS); _tile_loadd(5, xa + 16 * XS + c / 16, XS); }
          if (MODE >= 2) { _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7); }
        }
      }
      if (MODE >= 2) {  // the second pass from cache
        for (int64_t c = 0; c < PANEL; c += CH) {
          if (MODE == 4) { _tile_loadd(4, xa + 32 * XS + c / 16, XS); _tile_loadd(5, xa + 48 * XS + c / 16, XS); }
          _tile_loadd(6, p0 + c, 64); _tile_loadd(7, p1 + c, 64);
          _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
        }
      }
    }
  sink += _mm512_reduce_add_ps(acc);
  float c[256]; _tile_stored(0, c, 64); sink += c[0];
  return TOTAL * double(reps) / (now() - t0) / 1e9;
}
int main(int argc, char** argv) {
  syscall(SYS_arch_prctl, 0x1023, 18);
  Cfg cfg; for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.c[t] = 64; _tile_loadconfig(&cfg);
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3); _tile_zero(4); _tile_zero(5);
  char* base = (char*)mmap(nullptr, TOTAL + (4 << 20), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  buf = (char*)(((uintptr_t)base + (2 << 20) - 1) & ~uintptr_t((2 << 20) - 1));
  madvise(buf, TOTAL, MADV_HUGEPAGE);
  memset(buf, 1, TOTAL + 1024 * 64);
  xa = (char*)aligned_alloc(2 << 20, 2 << 20); memset(xa, 0, 2 << 20);
  const char* names[] = {"plain loads", "tiles, no pf", "tiles, T0+2", "tiles, T0+2, T1+8", "tiles, T0+2, T1+16", "product (2 passes), T0+2", "product, T0+2 T1+8", "product, T0+2 T1+16", "product+A, T0+2", "product+A, T0+2 T1+8"};
  std::vector<double> all[10];
  for (int round = 0; round < 7; ++round) {
    double v[10] = {run<3, 0>(2), run<0, 0>(2), run<1, 0>(2), run<1, 8>(2), run<1, 16>(2), run<2, 0>(2), run<2, 8>(2), run<2, 16>(2), run<4,0>(2), run<4,8>(2)};
    for (int i = 0; i < 10; ++i) all[i].push_back(v[i]);
  }
  for (int i = 0; i < 10; ++i) { std::sort(all[i].begin(), all[i].end()); printf("%-28s GB/s median %.1f  max %.1f\n", names[i], all[i][3], all[i][6]); }
  return sink == 12345;
}
