
#include <cuda_bf16.h>
#include <cuda_fp16.h>
__device__ __forceinline__ float kq_e2m1(unsigned v) {
  const float lut[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};
  return lut[v & 15u];
}
__device__ __forceinline__ float kq_e4m3(unsigned v) {
  unsigned s = (v >> 7) & 1u, e = (v >> 3) & 15u, m = v & 7u;
  float f = e == 0 ? ldexpf((float)m, -9) : ldexpf(1.f + m / 8.f, (int)e - 7);
  return s ? -f : f;
}
