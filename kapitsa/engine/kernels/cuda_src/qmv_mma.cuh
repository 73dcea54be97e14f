
#include <cuda_bf16.h>
#include <cuda_fp16.h>
__device__ __forceinline__ uint32_t kq3_u32(__nv_bfloat162 v) { return *reinterpret_cast<uint32_t*>(&v); }
__device__ __forceinline__ uint32_t kq3_u32(__half2 v) { return *reinterpret_cast<uint32_t*>(&v); }
__device__ __forceinline__ void kq3_mma(float* c, const uint32_t* a, uint32_t b0, uint32_t b1, const __nv_bfloat16*) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void kq3_mma(float* c, const uint32_t* a, uint32_t b0, uint32_t b1, const __half*) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// (s, s) and (b, b) as the 16-bit pair type of T.
__device__ __forceinline__ uint32_t kq3_pair(float v, const __nv_bfloat16*) { return kq3_u32(__float2bfloat162_rn(v)); }
__device__ __forceinline__ uint32_t kq3_pair(float v, const __half*) { return kq3_u32(__float2half2_rn(v)); }
// Pair (value i, value i + 4) of a 4-bit word, dequantized: (128 + q) - 128 is exact, then one fma.
__device__ __forceinline__ uint32_t kq3_deq4(uint32_t w, int i, uint32_t s2, uint32_t b2, const __nv_bfloat16*) {
  uint32_t u = ((w >> (4 * i)) & 0x000F000Fu) | 0x43004300u;
  uint32_t m = 0x43004300u;
  const __nv_bfloat162 q = __hsub2(*reinterpret_cast<__nv_bfloat162*>(&u), *reinterpret_cast<__nv_bfloat162*>(&m));
  return kq3_u32(__hfma2(q, *reinterpret_cast<__nv_bfloat162*>(&s2), *reinterpret_cast<__nv_bfloat162*>(&b2)));
}
__device__ __forceinline__ uint32_t kq3_deq4(uint32_t w, int i, uint32_t s2, uint32_t b2, const __half*) {
  uint32_t u = ((w >> (4 * i)) & 0x000F000Fu) | 0x64006400u;
  uint32_t m = 0x64006400u;
  const __half2 q = __hsub2(*reinterpret_cast<__half2*>(&u), *reinterpret_cast<__half2*>(&m));
  return kq3_u32(__hfma2(q, *reinterpret_cast<__half2*>(&s2), *reinterpret_cast<__half2*>(&b2)));
}
// Bytes (2j, 2j + 1) of an 8-bit word, dequantized in float32 and rounded once into a pair.
__device__ __forceinline__ uint32_t kq3_deq8(uint32_t w, int j, float s, float b, const __nv_bfloat16*) {
  const float lo = __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7440u + 2 * j)) - 8388608.f;
  const float hi = __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7441u + 2 * j)) - 8388608.f;
  return kq3_u32(__floats2bfloat162_rn(fmaf(lo, s, b), fmaf(hi, s, b)));
}
__device__ __forceinline__ uint32_t kq3_deq8(uint32_t w, int j, float s, float b, const __half*) {
  const float lo = __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7440u + 2 * j)) - 8388608.f;
  const float hi = __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7441u + 2 * j)) - 8388608.f;
  return kq3_u32(__floats2half2_rn(fmaf(lo, s, b), fmaf(hi, s, b)));
}
