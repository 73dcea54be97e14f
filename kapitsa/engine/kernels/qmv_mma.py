"""Quantized mat-vec v2, tensor-core variant (bf16/fp16 activations): the same contract and
formats as `qmv_fast` (MLX affine 4/8-bit, group 32/64/128, M <= 8 rows).

`qmv_fast` (SIMT) spends ~2 + M instructions per weight (decode, then one FMA per input row), so
with 8 rows it is compute-bound. Here each warp dequantizes weights straight into the A operand
of mma.sync m16n8k16 (16 output rows x 16 k, fp32 accumulation) and the M <= 8 input rows are
the 8 columns of B: the cost per weight no longer grows with M.
Fragment layout (PTX ISA, m16n8k16, lane = 4 * g + t): A regs {a0,a1,a2,a3} hold A[g][2t..2t+1],
A[g+8][2t..2t+1], A[g][2t+8..2t+9], A[g+8][2t+8..2t+9]; B regs {b0,b1} hold B[2t..2t+1][g],
B[2t+8..2t+9][g]; C regs {c0..c3} hold C[g][2t], C[g][2t+1], C[g+8][2t], C[g+8][2t+1].
A sum over k does not care which k a slot stands for, as long as A and B agree: lane t's four
slots come from its own 16-byte chunk of the row (chunk 4 * step + t), so a warp step covers 4
chunks, and the x values of that chunk fill B's slots in the same order. Groups are multiples
of 32, so each chunk has one scale and bias, applied while dequantizing (A = q * s + b rounded
once to bf16/fp16, as mx.dequantize rounds the weights).
4-bit: (w >> 4i) & 0x000F000F | magic gives the pair (value i, value i + 4) of a word as two
halves of 128 + q (bf16) or 1024 + q (fp16); the same pairs of x come from two byte_perms.
8-bit: bytes decode through float32 (no 16-bit magic holds 0..255 for bf16) and pack in order.
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx

from kapitsa.engine.kernels import backend
from kapitsa.engine.kernels.cuda import CudaKernel
from kapitsa.engine.kernels.qmv_fast import supports_fast

_MMA_HEADER = r"""
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
"""

_MMA_SOURCE = r"""
  constexpr int CH = 128 / BITS;               // values per 16-byte chunk
  constexpr int NCH = K / CH;
  constexpr int NSTEPS = (NCH + 3) / 4;        // a warp step: lanes t = 0..3 take chunks 4s + t
  constexpr int GROUPS = K / GS;
  constexpr int XV = CH / 8;                   // 16-byte x loads per chunk (8 values each)
  __shared__ float kq3_red[W][TM][4][32];      // per-warp partial sums (K is split over warps)
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int tile0 = blockIdx.x * 16 * TM;
  const uint4* wv = reinterpret_cast<const uint4*>(w);
  const uint4* xv = reinterpret_cast<const uint4*>(x + (size_t)(g < M ? g : 0) * K);
  int rows[TM][2];
  #pragma unroll
  for (int tm = 0; tm < TM; ++tm) {
    rows[tm][0] = min(tile0 + 16 * tm + g, N - 1);  // past N: recompute row N-1, never stored
    rows[tm][1] = min(tile0 + 16 * tm + g + 8, N - 1);
  }
  float c[TM][4];
  #pragma unroll
  for (int tm = 0; tm < TM; ++tm) { c[tm][0] = c[tm][1] = c[tm][2] = c[tm][3] = 0.f; }

  uint4 wq[TM][2], xq[XV];
  float sc[TM][2], bi[TM][2];
  // One step's loads: this lane's chunk of each of its 2 * TM rows, their scale and bias, and
  // (lanes g < M) the chunk's x values; a chunk past the row or a padding column reads x = 0.
  auto load = [&](int s, uint4 (&wq_)[TM][2], uint4 (&xq_)[XV], float (&sc_)[TM][2], float (&bi_)[TM][2]) {
    const int chunk = 4 * s + t;
    const int cc = chunk < NCH ? chunk : 0;
    #pragma unroll
    for (int tm = 0; tm < TM; ++tm) {
      #pragma unroll
      for (int h = 0; h < 2; ++h) {
        wq_[tm][h] = wv[(size_t)rows[tm][h] * NCH + cc];
        sc_[tm][h] = (float)scales[rows[tm][h] * GROUPS + cc * CH / GS];
        bi_[tm][h] = (float)biases[rows[tm][h] * GROUPS + cc * CH / GS];
      }
    }
    const bool live = g < M && chunk < NCH;
    #pragma unroll
    for (int v = 0; v < XV; ++v) xq_[v] = live ? xv[cc * XV + v] : make_uint4(0u, 0u, 0u, 0u);
  };
  if (warp < NSTEPS) load(warp, wq, xq, sc, bi);
  for (int s = warp; s < NSTEPS; s += W) {
    uint4 wn[TM][2], xn[XV];
    float sn[TM][2], bn[TM][2];
    if (s + W < NSTEPS) load(s + W, wn, xn, sn, bn);
    uint32_t s2[TM][2], b2[TM][2];               // (scale, scale), (bias, bias) in T, for 4-bit
    #pragma unroll
    for (int tm = 0; tm < TM; ++tm) {
      #pragma unroll
      for (int h = 0; h < 2; ++h) {
        s2[tm][h] = BITS == 4 ? kq3_pair(sc[tm][h], x) : 0u;
        b2[tm][h] = BITS == 4 ? kq3_pair(bi[tm][h], x) : 0u;
      }
    }
    #pragma unroll
    for (int word = 0; word < 4; ++word) {
      if constexpr (BITS == 4) {
        // x values 8 * word .. + 7 of the chunk, paired (i, i + 4) like the weights
        const uint4 u = xq[word];
        const uint32_t b[4] = {__byte_perm(u.x, u.z, 0x5410u), __byte_perm(u.x, u.z, 0x7632u),
                               __byte_perm(u.y, u.w, 0x5410u), __byte_perm(u.y, u.w, 0x7632u)};
        #pragma unroll
        for (int tm = 0; tm < TM; ++tm) {
          uint32_t p[2][4];
          #pragma unroll
          for (int h = 0; h < 2; ++h) {
            const uint4 q = wq[tm][h];
            const uint32_t wd = word == 0 ? q.x : word == 1 ? q.y : word == 2 ? q.z : q.w;
            #pragma unroll
            for (int i = 0; i < 4; ++i) p[h][i] = kq3_deq4(wd, i, s2[tm][h], b2[tm][h], x);
          }
          const uint32_t a0[4] = {p[0][0], p[1][0], p[0][1], p[1][1]};
          const uint32_t a1[4] = {p[0][2], p[1][2], p[0][3], p[1][3]};
          kq3_mma(c[tm], a0, b[0], b[1], x);
          kq3_mma(c[tm], a1, b[2], b[3], x);
        }
      } else {
        // x values 4 * word .. + 3 of the chunk, in order
        const uint4 u = xq[word >> 1];
        const uint32_t b0 = (word & 1) ? u.z : u.x, b1 = (word & 1) ? u.w : u.y;
        #pragma unroll
        for (int tm = 0; tm < TM; ++tm) {
          uint32_t a[4];
          #pragma unroll
          for (int h = 0; h < 2; ++h) {
            const uint4 q = wq[tm][h];
            const uint32_t wd = word == 0 ? q.x : word == 1 ? q.y : word == 2 ? q.z : q.w;
            a[h] = kq3_deq8(wd, 0, sc[tm][h], bi[tm][h], x);
            a[2 + h] = kq3_deq8(wd, 1, sc[tm][h], bi[tm][h], x);
          }
          kq3_mma(c[tm], a, b0, b1, x);
        }
      }
    }
    #pragma unroll
    for (int tm = 0; tm < TM; ++tm) {
      #pragma unroll
      for (int h = 0; h < 2; ++h) { wq[tm][h] = wn[tm][h]; sc[tm][h] = sn[tm][h]; bi[tm][h] = bn[tm][h]; }
    }
    #pragma unroll
    for (int v = 0; v < XV; ++v) xq[v] = xn[v];
  }

  #pragma unroll
  for (int tm = 0; tm < TM; ++tm) {
    #pragma unroll
    for (int e = 0; e < 4; ++e) kq3_red[warp][tm][e][lane] = c[tm][e];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < TM * 4 * 32; i += W * 32) {
    const int tm = i / 128, e = (i / 32) & 3, l = i & 31;
    float v = 0.f;
    #pragma unroll
    for (int ww = 0; ww < W; ++ww) v += kq3_red[ww][tm][e][l];
    const int row = tile0 + 16 * tm + (l >> 2) + (e >= 2 ? 8 : 0);
    const int m = 2 * (l & 3) + (e & 1);
    if (m < M && row < N) y[(size_t)m * N + row] = (T)v;
  }
"""

_MMA_KERNEL = CudaKernel(
    name="kapitsa_qmv_mma",
    input_names=("x", "w", "scales", "biases"),
    output_names=("y",),
    source=_MMA_SOURCE,
    header=_MMA_HEADER,
)
MMA_TILES = 2  # 16-row tiles per block (they share each x load)
MMA_WARPS = 8  # warps per block, splitting K


def mma_launch_config(x: mx.array, n: int, *, group_size: int, bits: int) -> tuple[tuple, int, int]:
    """(template arguments, grid threads, block threads) of the tensor-core variant."""
    rows, k = x.shape
    return _mma_launch_config(x.dtype, rows, n, k, group_size, bits, MMA_TILES, MMA_WARPS)


@functools.cache  # called per mat-vec of every decode step: keep the host work to a dict lookup
def _mma_launch_config(dtype, rows, n, k, group_size, bits, tiles, warps) -> tuple[tuple, int, int]:
    template = (
        ("T", dtype),
        ("M", rows),
        ("N", n),
        ("K", k),
        ("GS", group_size),
        ("BITS", bits),
        ("TM", tiles),
        ("W", warps),
    )
    blocks = math.ceil(n / (16 * tiles))
    return template, blocks * warps * 32, warps * 32


def supports_mma(
    x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None, *, group_size: int, bits: int
) -> bool:
    """The tensor-core variant: CUDA, bf16/fp16 activations, the same formats as the SIMT one."""
    return (
        backend() == "cuda"
        and x.dtype in (mx.bfloat16, mx.float16)
        and supports_fast(x, w, scales, biases, group_size=group_size, bits=bits)
    )


def qmv_mma(
    x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, *, group_size: int, bits: int
) -> mx.array:
    """Tensor-core v2: same contract as `qmv_fast` (check `supports_mma` first). Weights are
    rounded to x's dtype after dequantizing, as `mx.dequantize` does; products sum in float32."""
    n = w.shape[0]
    template, grid, block = mma_launch_config(x, n, group_size=group_size, bits=bits)
    return _MMA_KERNEL(
        [x, w, scales, biases],
        template=template,
        grid=(grid, 1, 1),
        threadgroup=(block, 1, 1),
        output_shapes=[(x.shape[0], n)],
        output_dtypes=[x.dtype],
    )[0]
