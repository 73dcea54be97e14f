"""Quantized mat-vec, second generation: y[M, N] = x[M, K] @ dequantize(W)[N, K]^T for M <= 8,
MLX affine 4-bit and 8-bit weights, group size 32/64/128, bf16/fp16/fp32 activations.

Why it is shaped this way (v1 in qmv.py streamed a 27B chain at 0.89 TB/s against 3.77 TB/s for
a plain read on the H200):
- Each warp computes R output rows and each lane always owns the same 16-byte chunks of K
  (32 values at 4 bits, 16 at 8), so the x values a lane reads from shared memory serve all R
  rows, and a block of WARPS x R rows stages x once (v1 staged it once per 8 rows).
- x is staged as float in shared memory, one chunk per thread with 16-byte loads; each chunk is
  padded to CH + 4 floats so a quarter-warp of float4 reads (lanes 144 or 80 bytes apart) hits
  distinct banks. The chunk's sum is staged beside it: the group bias enters as bias * sum(x),
  never per value. K beyond the shared-memory budget is staged tile by tile.
- Weights are loaded one chunk ahead (R 16-byte loads per lane in flight while the current chunk
  is computed), including across tile boundaries.
- Dequantisation without shifts per value or int->float conversions: a masked field OR'ed into
  the mantissa of 2^23 is the float 2^23 + q * 2^p; one FMA by 2^-p, minus 2^(23-p), gives q
  exactly. The dot product over a chunk is sum(q * x); the chunk (inside one group, as groups are
  multiples of 32) then adds scale * dot + bias * sum(x). Everything accumulates in float32.
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx

from kapitsa.engine.kernels import backend
from kapitsa.engine.kernels.cuda import CudaKernel
from kapitsa.engine.kernels.metal import MetalKernel

MAX_ROWS = 8
BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
DTYPES = (mx.bfloat16, mx.float16, mx.float32)
SHARED_BUDGET = 44 * 1024  # under the 48 KiB a CUDA kernel gets without an opt-in
METAL_SHARED_BUDGET = 28 * 1024  # Apple GPUs have 32 KiB of threadgroup memory
PAD = 4  # floats after each staged chunk (bank-conflict-free float4 reads)

_HEADER = r"""
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
"""

_SOURCE = r"""
  constexpr int CH = 128 / BITS;               // values per 16-byte chunk of a row
  constexpr int NCH = K / CH;                  // chunks per row
  constexpr int ROUNDS = (NCH + 31) / 32;      // a round: every lane takes one chunk
  constexpr int TCH = TILE_ROUNDS * 32 < NCH ? TILE_ROUNDS * 32 : NCH;  // chunks per staged tile
  constexpr int STRIDE = CH + 4;               // staged floats per chunk (padded)
  constexpr int GROUPS = K / GS;
  extern __shared__ __align__(16) float kq2_smem[];
  float* xs = kq2_smem;                        // [M][TCH][STRIDE]
  float* xsum = kq2_smem + M * TCH * STRIDE;   // [M][TCH]
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int row0 = (blockIdx.x * WARPS + warp) * R;
  const uint4* wv = reinterpret_cast<const uint4*>(w);
  int rows[R];
  #pragma unroll
  for (int r = 0; r < R; ++r) rows[r] = min(row0 + r, N - 1);  // past N: recompute row N-1, never stored

  uint4 cur[R];
  float cur_s[R], cur_b[R];
  #pragma unroll
  for (int r = 0; r < R; ++r) {
    const int c = lane < NCH ? lane : 0;
    cur[r] = wv[(size_t)rows[r] * NCH + c];
    cur_s[r] = (float)scales[rows[r] * GROUPS + c * CH / GS];
    cur_b[r] = (float)biases[rows[r] * GROUPS + c * CH / GS];
  }
  float acc[R][M];
  #pragma unroll
  for (int r = 0; r < R; ++r) {
    #pragma unroll
    for (int m = 0; m < M; ++m) acc[r][m] = 0.f;
  }

  for (int j = 0; j < ROUNDS; ++j) {
    const int c0 = (j / TILE_ROUNDS) * TCH;    // first chunk of the staged tile
    if (j % TILE_ROUNDS == 0) {
      const int tile_chunks = min(TCH, NCH - c0);
      __syncthreads();                           // the previous tile is no longer read
      for (int i = threadIdx.x; i < M * tile_chunks; i += WARPS * 32) {
        const int m = i / tile_chunks, cl = i - m * tile_chunks;
        const T* src = x + (size_t)m * K + (size_t)(c0 + cl) * CH;
        float* dst = xs + (m * TCH + cl) * STRIDE;
        float total = 0.f;
        #pragma unroll
        for (int e = 0; e < CH; e += 8) {
          float v[8];
          kq2_load8(src + e, v);
          #pragma unroll
          for (int t = 0; t < 8; ++t) total += v[t];
          *reinterpret_cast<float4*>(dst + e) = make_float4(v[0], v[1], v[2], v[3]);
          *reinterpret_cast<float4*>(dst + e + 4) = make_float4(v[4], v[5], v[6], v[7]);
        }
        xsum[m * TCH + cl] = total;
      }
      __syncthreads();
    }
    const int c = j * 32 + lane;
    // Next round's chunk: its loads are in flight while this one is computed.
    uint4 nxt[R];
    float nxt_s[R], nxt_b[R];
    const int cn = c + 32 < NCH ? c + 32 : 0;
    #pragma unroll
    for (int r = 0; r < R; ++r) {
      nxt[r] = wv[(size_t)rows[r] * NCH + cn];
      nxt_s[r] = (float)scales[rows[r] * GROUPS + cn * CH / GS];
      nxt_b[r] = (float)biases[rows[r] * GROUPS + cn * CH / GS];
    }
    if (c < NCH) {
      const int cl = c - c0;
      float dot[R][M];
      #pragma unroll
      for (int r = 0; r < R; ++r) {
        #pragma unroll
        for (int m = 0; m < M; ++m) dot[r][m] = 0.f;
      }
      #pragma unroll
      for (int q4 = 0; q4 < CH / 4; ++q4) {     // 4 values at a time: one float4 of x per row
        const int word = BITS == 4 ? q4 >> 1 : q4;
        float4 qv[R];
        #pragma unroll
        for (int r = 0; r < R; ++r) {
          const uint32_t wd = word == 0 ? cur[r].x : word == 1 ? cur[r].y : word == 2 ? cur[r].z : cur[r].w;
          if constexpr (BITS == 4) qv[r] = kq2_nibbles(wd, q4 & 1);
          else qv[r] = kq2_bytes(wd);
        }
        #pragma unroll
        for (int m = 0; m < M; ++m) {
          const float4 xv = *reinterpret_cast<const float4*>(xs + (m * TCH + cl) * STRIDE + 4 * q4);
          #pragma unroll
          for (int r = 0; r < R; ++r) {
            dot[r][m] = fmaf(qv[r].x, xv.x, dot[r][m]);
            dot[r][m] = fmaf(qv[r].y, xv.y, dot[r][m]);
            dot[r][m] = fmaf(qv[r].z, xv.z, dot[r][m]);
            dot[r][m] = fmaf(qv[r].w, xv.w, dot[r][m]);
          }
        }
      }
      #pragma unroll
      for (int m = 0; m < M; ++m) {
        const float sx = xsum[m * TCH + cl];
        #pragma unroll
        for (int r = 0; r < R; ++r) acc[r][m] = fmaf(cur_s[r], dot[r][m], fmaf(cur_b[r], sx, acc[r][m]));
      }
    }
    #pragma unroll
    for (int r = 0; r < R; ++r) { cur[r] = nxt[r]; cur_s[r] = nxt_s[r]; cur_b[r] = nxt_b[r]; }
  }

  #pragma unroll
  for (int r = 0; r < R; ++r) {
    #pragma unroll
    for (int m = 0; m < M; ++m) {
      float v = acc[r][m];
      #pragma unroll
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (lane == 0 && row0 + r < N) y[(size_t)m * N + row0 + r] = (T)v;
    }
  }
"""

_KERNEL = CudaKernel(
    name="kapitsa_qmv_fast",
    input_names=("x", "w", "scales", "biases"),
    output_names=("y",),
    source=_SOURCE,
    header=_HEADER,
)

# The same algorithm for Apple GPUs (metal/qmv.metal, unverified on hardware): SMEM_FLOATS sizes
# its threadgroup array, which Metal declares statically.
_METAL_KERNEL = MetalKernel(
    name="kapitsa_qmv_fast",
    filename="qmv.metal",
    input_names=("x", "w", "scales", "biases"),
    output_names=("y",),
)

# (rows per warp, warps per block) by number of input rows: the register budget is about
# R * (8 + 2M) floats, and a block keeps ~16 rows so staging x stays a few percent of the work.
_SHAPE_BY_ROWS = {1: (4, 4), 2: (4, 4), 3: (4, 4), 4: (4, 4), 5: (2, 8), 6: (2, 8), 7: (2, 8), 8: (2, 8)}


def chunk_values(bits: int) -> int:
    """Values in one 16-byte chunk of a packed row."""
    return 128 // bits


def tile_rounds(rows: int, k: int, bits: int, budget: int | None = None) -> int:
    """Rounds (32 chunks each) of x staged per tile: as many as fit the budget, at least one."""
    ch = chunk_values(bits)
    per_round = rows * 32 * (ch + PAD + 1) * 4
    budget = SHARED_BUDGET if budget is None else budget
    return max(1, min(math.ceil(k / ch / 32), budget // per_round))


def shared_bytes(rows: int, k: int, bits: int, budget: int | None = None) -> int:
    ch = chunk_values(bits)
    tile_chunks = min(tile_rounds(rows, k, bits, budget) * 32, k // ch)
    return rows * tile_chunks * (ch + PAD + 1) * 4


def launch_config(
    x: mx.array, n: int, *, group_size: int, bits: int, budget: int | None = None
) -> tuple[tuple, int, int, int]:
    """(template arguments, shared bytes, grid threads, block threads) for one call."""
    rows, k = x.shape
    budget = SHARED_BUDGET if budget is None else budget
    return _launch_config(x.dtype, rows, n, k, group_size, bits, budget, _SHAPE_BY_ROWS[rows])


@functools.cache  # called per mat-vec of every decode step: keep the host work to a dict lookup
def _launch_config(dtype, rows, n, k, group_size, bits, budget, shape) -> tuple[tuple, int, int, int]:
    r, warps = shape
    template = (
        ("T", dtype),
        ("M", rows),
        ("N", n),
        ("K", k),
        ("GS", group_size),
        ("BITS", bits),
        ("R", r),
        ("WARPS", warps),
        ("TILE_ROUNDS", tile_rounds(rows, k, bits, budget)),
    )
    blocks = math.ceil(n / (r * warps))
    return template, shared_bytes(rows, k, bits, budget), blocks * warps * 32, warps * 32


def metal_launch_config(x: mx.array, n: int, *, group_size: int, bits: int) -> tuple[tuple, int, int]:
    """(template arguments incl. SMEM_FLOATS, grid threads, threadgroup threads) for Metal."""
    template, shared, grid, block = launch_config(
        x, n, group_size=group_size, bits=bits, budget=METAL_SHARED_BUDGET
    )
    return (*template, ("SMEM_FLOATS", math.ceil(shared / 16) * 4)), grid, block


def supports_fast(
    x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None, *, group_size: int, bits: int
) -> bool:
    """Whether the v2 kernel can run this call (CUDA or Metal, affine 4/8-bit, shapes it handles)."""
    if backend() not in ("cuda", "metal") or biases is None or x.ndim != 2 or w.ndim != 2:
        return False
    rows, k = x.shape
    if backend() == "metal" and shared_bytes(rows, k, bits, METAL_SHARED_BUDGET) > METAL_SHARED_BUDGET:
        return False  # one round of staged x (32 chunks per row) must fit Apple's 32 KiB
    return (
        1 <= rows <= MAX_ROWS
        and bits in BITS
        and group_size in GROUP_SIZES
        and x.dtype in DTYPES
        and k % group_size == 0
        and w.shape[1] * 32 == k * bits
        and scales.shape == (w.shape[0], k // group_size)
        and biases.shape == scales.shape
    )


def qmv_fast(
    x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, *, group_size: int, bits: int
) -> mx.array:
    """The v2 kernel: x [M, K] @ dequantize(w)[N, K]^T -> [M, N] in x's dtype. Callers check
    `supports_fast` first (qmv.qmv does, and falls back otherwise)."""
    n = w.shape[0]
    if backend() == "metal":
        template, grid, block = metal_launch_config(x, n, group_size=group_size, bits=bits)
        return _METAL_KERNEL(
            [x, w, scales, biases],
            template=template,
            grid=(grid, 1, 1),
            threadgroup=(block, 1, 1),
            output_shapes=[(x.shape[0], n)],
            output_dtypes=[x.dtype],
        )[0]
    template, shared, grid, block = launch_config(x, n, group_size=group_size, bits=bits)
    return _KERNEL(
        [x, w, scales, biases],
        template=template,
        grid=(grid, 1, 1),
        threadgroup=(block, 1, 1),
        output_shapes=[(x.shape[0], n)],
        output_dtypes=[x.dtype],
        shared_memory=shared,
    )[0]
