
#include <cuda_bf16.h>
#include <cuda_fp16.h>
// V consecutive floats from/to 16- or 8-byte aligned addresses (state rows and shared B/C rows).
template <int V> __device__ __forceinline__ void km_load(const float* src, float* dst) {
  if constexpr (V == 4) {
    const float4 u = *reinterpret_cast<const float4*>(src);
    dst[0] = u.x; dst[1] = u.y; dst[2] = u.z; dst[3] = u.w;
  } else if constexpr (V == 2) {
    const float2 u = *reinterpret_cast<const float2*>(src);
    dst[0] = u.x; dst[1] = u.y;
  } else {
    dst[0] = src[0];
  }
}
template <int V> __device__ __forceinline__ void km_store(float* dst, const float* src) {
  if constexpr (V == 4) {
    *reinterpret_cast<float4*>(dst) = make_float4(src[0], src[1], src[2], src[3]);
  } else if constexpr (V == 2) {
    *reinterpret_cast<float2*>(dst) = make_float2(src[0], src[1]);
  } else {
    dst[0] = src[0];
  }
}
__device__ __forceinline__ float km_silu(float v) { return v / (1.f + expf(-v)); }
// log(1 + e^v) as MLX's logaddexp(v, 0) computes it: exact for large |v|.
__device__ __forceinline__ float km_softplus(float v) { return fmaxf(v, 0.f) + log1pf(expf(-fabsf(v))); }
