// ab LIB_A LIB_B ROWS [hot|distinct]: cold products of the model's four shapes (hot: one copy; distinct:
// each copy packed from its own random weight), the two libraries alternated per round; y 64-byte aligned
#include <dlfcn.h>
#include <sys/mman.h>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>
#include <cstring>
#include <algorithm>
typedef void (*Pack)(const uint16_t*, int64_t, int64_t, uint16_t*);
typedef void (*Lin)(const float*, int64_t, const uint16_t*, const float*, float*, int64_t, int64_t, int64_t, int);
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
int main(int argc, char** argv) {
  Lin lin[2]; Pack pack = nullptr;
  for (int i = 0; i < 2; ++i) { void* h = dlopen(argv[1 + i], RTLD_NOW | RTLD_LOCAL); if (!h) { puts(dlerror()); return 1; }
    lin[i] = (Lin)dlsym(h, "pipeserve_packed_linear_bf16"); if (!pack) pack = (Pack)dlsym(h, "pipeserve_pack_weight_bf16"); }
  const int64_t m = atoi(argv[3]);
  const bool hot = argc > 4 && std::string(argv[4]) == "hot", distinct = argc > 4 && std::string(argv[4]) == "distinct";
  const char* shapes[] = {"1280x768", "768x768", "4096x768", "768x2048"};
  for (const char* s : shapes) {
    int64_t n, k; sscanf(s, "%ldx%ld", &n, &k);
    const int64_t pairs = (k + 31) / 32 * 16, wbytes = n * pairs * 4, copies = std::max<int64_t>(2, (int64_t(64) << 20) / wbytes);
    size_t total = copies * wbytes + (2 << 20);
    char* base = (char*)mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    char* al = (char*)(((uintptr_t)base + (2 << 20) - 1) & ~uintptr_t((2 << 20) - 1));
    madvise(al, copies * wbytes, MADV_HUGEPAGE);
    std::vector<uint16_t> w(n * k); for (auto& v : w) v = (rand() & 1 ? 0xbc00 : 0x3c00) + (rand() & 0x3ff);
    for (int64_t c = 0; c < copies; ++c) {
      if (distinct && c > 0) for (auto& v : w) v = (rand() & 1 ? 0xbc00 : 0x3c00) + (rand() & 0x3ff);
      pack(w.data(), n, k, (uint16_t*)(al + c * wbytes));
    }
    std::vector<float> x(m * k); for (auto& v : x) v = rand() / float(RAND_MAX) - 0.5f;
    std::vector<float> y_(m * n + 16), y2_(m * n + 16);
    float* yp = (float*)(((uintptr_t)y_.data() + 63) & ~uintptr_t(63)); float* y2p = (float*)(((uintptr_t)y2_.data() + 63) & ~uintptr_t(63));
    lin[0](x.data(), k, (const uint16_t*)al, nullptr, yp, m, n, k, 1);
    lin[1](x.data(), k, (const uint16_t*)al, nullptr, y2p, m, n, k, 1);
    if (memcmp(yp, y2p, m * n * 4)) printf("  DIFFERENT OUTPUTS\n");
    std::vector<double> t[2];
    for (int rep = 0; rep < 15; ++rep)
      for (int j = 0; j < 2; ++j) {
        const int i = rep % 2 ? 1 - j : j;
        double t0 = now();
        for (int c = 0; c < 2 * copies; ++c) lin[i](x.data(), k, (const uint16_t*)(al + (hot ? 0 : (c % copies) * wbytes)), nullptr, yp, m, n, k, 1);
        t[i].push_back((now() - t0) / (2 * copies));
      }
    printf("%-9s", s);
    for (int i = 0; i < 2; ++i) { std::sort(t[i].begin(), t[i].end()); printf("  %s %.0f GF/s [%.0f-%.0f]", i ? "B" : "A", 2.0 * m * n * k / t[i][7] / 1e9, 2.0 * m * n * k / t[i][14] / 1e9, 2.0 * m * n * k / t[i][0] / 1e9); }
    printf("  B/A %.3f\n", t[0][7] / t[1][7]);
    munmap(base, total);
  }
}
