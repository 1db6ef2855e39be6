#include <stdint.h>
typedef void (*Lin)(const float*, int64_t, const uint16_t*, const float*, float*, int64_t, int64_t, int64_t, int);
// calls lin over `copies` packed weights (pointers in ws), `times` rounds
void loop(void* fn, const float* x, const uint16_t** ws, int64_t copies, float* y, int64_t m, int64_t n, int64_t k, int times) {
  Lin lin = (Lin)fn;
  for (int t = 0; t < times; ++t)
    for (int64_t c = 0; c < copies; ++c) lin(x, k, ws[c], 0, y, m, n, k, 1);
}
