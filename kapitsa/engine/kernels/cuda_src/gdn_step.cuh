
#include <cuda_bf16.h>
#include <cuda_fp16.h>
// x rounded to dtype U and back: where the op-by-op path stores an intermediate in U.
template <typename U>
__device__ __forceinline__ float gdn_round(float x) { return static_cast<float>(static_cast<U>(x)); }
__device__ __forceinline__ float gdn_sigmoid(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float gdn_softplus(float x) { return fmaxf(x, 0.f) + log1pf(expf(-fabsf(x))); }
// Sums each of N values over the warp; every lane gets the totals (N independent chains for ILP).
template <int N>
__device__ __forceinline__ void gdn_warp_sum(float (&v)[N]) {
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    #pragma unroll
    for (int i = 0; i < N; ++i) v[i] += __shfl_xor_sync(0xffffffffu, v[i], o);
  }
}
// Column of slot j of a lane's share of a row: VEC contiguous floats per 32*VEC-wide chunk, so a
// warp reads a row in coalesced VEC-wide vectors.
template <int VEC>
__device__ __forceinline__ int gdn_col(int lane, int j) { return (j / VEC) * 32 * VEC + lane * VEC + j % VEC; }
template <int VEC, int COLS>
__device__ __forceinline__ void gdn_load_row(const float* row, int lane, float (&dst)[COLS]) {
  #pragma unroll
  for (int c = 0; c < COLS / VEC; ++c) {
    const float* p = row + c * 32 * VEC + lane * VEC;
    if constexpr (VEC == 4) {
      const float4 v = *reinterpret_cast<const float4*>(p);
      dst[4 * c] = v.x; dst[4 * c + 1] = v.y; dst[4 * c + 2] = v.z; dst[4 * c + 3] = v.w;
    } else if constexpr (VEC == 2) {
      const float2 v = *reinterpret_cast<const float2*>(p);
      dst[2 * c] = v.x; dst[2 * c + 1] = v.y;
    } else {
      dst[c] = p[0];
    }
  }
}
template <int VEC, int COLS>
__device__ __forceinline__ void gdn_store_row(float* row, int lane, const float (&src)[COLS]) {
  #pragma unroll
  for (int c = 0; c < COLS / VEC; ++c) {
    float* p = row + c * 32 * VEC + lane * VEC;
    if constexpr (VEC == 4) {
      float4 v;  // (no make_float4: keep to what NVRTC surely provides)
      v.x = src[4 * c]; v.y = src[4 * c + 1]; v.z = src[4 * c + 2]; v.w = src[4 * c + 3];
      *reinterpret_cast<float4*>(p) = v;
    } else if constexpr (VEC == 2) {
      float2 v;
      v.x = src[2 * c]; v.y = src[2 * c + 1];
      *reinterpret_cast<float2*>(p) = v;
    } else {
      p[0] = src[c];
    }
  }
}
