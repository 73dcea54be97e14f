
#include <cuda_bf16.h>
#include <cuda_fp16.h>
// 8 consecutive activations as float (16-byte aligned source).
__device__ __forceinline__ void kq2_load8(const __nv_bfloat16* p, float* o) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const uint32_t v[4] = {u.x, u.y, u.z, u.w};
  #pragma unroll
  for (int i = 0; i < 4; ++i) {
    o[2 * i] = __uint_as_float(v[i] << 16);           // bf16 is the top half of a float
    o[2 * i + 1] = __uint_as_float(v[i] & 0xffff0000u);
  }
}
__device__ __forceinline__ void kq2_load8(const __half* p, float* o) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const __half2* h = reinterpret_cast<const __half2*>(&u);
  #pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(h[i]);
    o[2 * i] = f.x;
    o[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ void kq2_load8(const float* p, float* o) {
  const float4 a = *reinterpret_cast<const float4*>(p);
  const float4 b = *reinterpret_cast<const float4*>(p + 4);
  o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w; o[4] = b.x; o[5] = b.y; o[6] = b.z; o[7] = b.w;
}
// The field (w & mask) sits at bit p of the mantissa of 2^23: the float is 2^23 + q * 2^p, and
// fma(f, 2^-p, -2^(23-p)) is q with no rounding (both steps are exact in float32).
__device__ __forceinline__ float kq2_field(uint32_t w, uint32_t mask, float inv, float off) {
  return fmaf(__uint_as_float((w & mask) | 0x4B000000u), inv, off);
}
// Values 4h..4h+3 of a 32-bit word of 4-bit weights (h = 0 or 1).
__device__ __forceinline__ float4 kq2_nibbles(uint32_t w, int h) {
  if (h == 0) {
    return make_float4(kq2_field(w, 0xFu, 1.f, -8388608.f), kq2_field(w, 0xF0u, 0.0625f, -524288.f),
                       kq2_field(w, 0xF00u, 0.00390625f, -32768.f),
                       kq2_field(w, 0xF000u, 0.000244140625f, -2048.f));
  }
  const uint32_t hi = w >> 12;  // values 5, 6, 7 move to bits 8, 12, 16
  return make_float4(kq2_field(w, 0xF0000u, 1.52587890625e-05f, -128.f),
                     kq2_field(hi, 0xF00u, 0.00390625f, -32768.f),
                     kq2_field(hi, 0xF000u, 0.000244140625f, -2048.f),
                     kq2_field(hi, 0xF0000u, 1.52587890625e-05f, -128.f));
}
// The four bytes of a word of 8-bit weights: byte_perm puts byte i under the exponent 0x4B.
__device__ __forceinline__ float4 kq2_bytes(uint32_t w) {
  return make_float4(__uint_as_float(__byte_perm(w, 0x4B000000u, 0x7440u)) - 8388608.f,
                     __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7441u)) - 8388608.f,
                     __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7442u)) - 8388608.f,
                     __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7443u)) - 8388608.f);
}
