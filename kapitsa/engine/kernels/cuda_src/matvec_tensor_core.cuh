
#include <cuda_bf16.h>
// Two 4-bit values of a word as a bf16 pair: nibbles i (low half) and i + 4 (high half) land in
// the mantissas of 128.0 (0x4300, whose mantissa step is 1), giving exactly 128 + q each.
// With EXACT, 128 is subtracted (exact: both are bf16 integers below 256) to leave q.
template <bool EXACT>
__device__ __forceinline__ uint32_t ktc_pair(uint32_t w, int i) {
  const uint32_t biased = ((w >> (4 * i)) & 0x000F000Fu) | 0x43004300u;
  if constexpr (!EXACT) return biased;
  __nv_bfloat162 v;
  memcpy(&v, &biased, 4);
  v = __hsub2(v, __floats2bfloat162_rn(128.f, 128.f));
  uint32_t out;
  memcpy(&out, &v, 4);
  return out;
}
// The bf16 pairs (x_i, x_{i+4}) matching ktc_pair(w, i), from 8 consecutive bf16 in 4 words.
__device__ __forceinline__ uint32_t ktc_xpair(const uint32_t* x, int i) {
  const uint32_t lo = x[i >> 1], hi = x[2 + (i >> 1)];
  return __byte_perm(lo, hi, (i & 1) ? 0x7632 : 0x5410);
}
#if defined(__CUDA_ARCH__)
// D = A (16x16 bf16, row) * B (16x8 bf16, col) + C, float accumulators (PTX ISA fragment layout).
__device__ __forceinline__ void ktc_mma(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#elif defined(KAPITSA_EMULATE)
void kapitsa_emu_mma(float* d, const uint32_t* a, uint32_t b0, uint32_t b1);  // tests' CPU emulator
__device__ __forceinline__ void ktc_mma(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
  kapitsa_emu_mma(d, a, b0, b1);
}
#endif
