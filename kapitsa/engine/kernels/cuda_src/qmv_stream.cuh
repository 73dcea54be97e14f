// Asynchronous global -> shared copies (cp.async, sm_80+) and ldmatrix.x4 for the streaming
// mat-vec (qmv_stream.cu). Under the tests' host emulator (KAPITSA_EMULATE) the copies are plain
// memcpys and ldmatrix is a warp exchange the emulator defines.
#if defined(__CUDA_ARCH__)
#define KST_SHARED extern __shared__ __align__(128) unsigned char kst_smem[]
__device__ __forceinline__ uint32_t kst_addr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
// Weights: 16 bytes, cached in L2 only (each is read once per token).
__device__ __forceinline__ void kst_copy_stream(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(kst_addr(dst)), "l"(src) : "memory");
}
// x, norm weights, scales and biases: BYTES (4, 8 or 16) through L1 (every warp of an SM reads x).
template <int BYTES>
__device__ __forceinline__ void kst_copy_shared(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(kst_addr(dst)), "l"(src), "n"(BYTES) : "memory");
}
__device__ __forceinline__ void kst_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int PENDING>
__device__ __forceinline__ void kst_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory"); }
// Four 8x8 matrices of 16-bit values (here: 8 rows x 16 bytes of packed weights each); lane l
// gives the row address of matrix l / 8, row l % 8, and receives word l % 4 of row l / 4 of each.
__device__ __forceinline__ void kst_ldmatrix4(uint32_t* r, const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(kst_addr(row))
               : "memory");
}
#elif defined(KAPITSA_EMULATE)
unsigned char* kapitsa_emu_smem();                         // the emulator's block shared memory
void kapitsa_emu_ldmatrix4(uint32_t* r, const void* row);  // the emulator's warp exchange
#define KST_SHARED unsigned char* const kst_smem = kapitsa_emu_smem()
inline void kst_copy_stream(void* dst, const void* src) { memcpy(dst, src, 16); }
template <int BYTES>
inline void kst_copy_shared(void* dst, const void* src) { memcpy(dst, src, BYTES); }
inline void kst_commit() {}
template <int PENDING>
inline void kst_wait() {}
inline void kst_ldmatrix4(uint32_t* r, const void* row) { kapitsa_emu_ldmatrix4(r, row); }
#endif
__device__ __forceinline__ float kst_float(uint32_t bits) {
  float f;
  memcpy(&f, &bits, 4);
  return f;
}
// 8 bf16 (16 bytes) as floats, and back.
__device__ __forceinline__ void kst_unpack8(const uint4 q, float* v) {
  const uint32_t w[4] = {q.x, q.y, q.z, q.w};
  #pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = kst_float(w[i] << 16);
    v[2 * i + 1] = kst_float(w[i] & 0xFFFF0000u);
  }
}
__device__ __forceinline__ uint4 kst_pack8(const float* v) {
  uint32_t w[4];
  #pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_bfloat162 p = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
    memcpy(&w[i], &p, 4);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}
