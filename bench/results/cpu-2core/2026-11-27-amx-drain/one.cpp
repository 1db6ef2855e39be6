// one LIB ROWS N K [hot]: the product alone, for perf
#include <dlfcn.h>
#include <sys/mman.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>
typedef void (*Pack)(const uint16_t*, int64_t, int64_t, uint16_t*);
typedef void (*Lin)(const float*, int64_t, const uint16_t*, const float*, float*, int64_t, int64_t, int64_t, int);
int main(int argc, char** argv) {
  void* h = dlopen(argv[1], RTLD_NOW); Lin lin = (Lin)dlsym(h, "pipeserve_packed_linear_bf16"); Pack pack = (Pack)dlsym(h, "pipeserve_pack_weight_bf16");
  int64_t m = atoi(argv[2]), n = atoi(argv[3]), k = atoi(argv[4]); bool hot = argc > 5;
  const int64_t pairs = (k + 31) / 32 * 16, wbytes = n * pairs * 4, copies = hot ? 1 : (int64_t(64) << 20) / wbytes;
  char* base = (char*)mmap(nullptr, copies * wbytes + (4 << 20), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  char* al = (char*)(((uintptr_t)base + (2 << 20) - 1) & ~uintptr_t((2 << 20) - 1));
  madvise(al, copies * wbytes, MADV_HUGEPAGE);
  std::vector<uint16_t> w(n * k); for (auto& v : w) v = 0x3c00 + (rand() & 0x3ff);
  for (int64_t c = 0; c < copies; ++c) pack(w.data(), n, k, (uint16_t*)(al + c * wbytes));
  float* x = (float*)aligned_alloc(64, m * k * 4); for (int64_t i = 0; i < m * k; ++i) x[i] = 0.5f;
  float* y = (float*)aligned_alloc(64, m * n * 4);
  for (int r = 0; r < 20000; ++r) lin(x, k, (const uint16_t*)(al + (r % copies) * wbytes), nullptr, y, m, n, k, 1);
  printf("%f\n", y[0]);
}
