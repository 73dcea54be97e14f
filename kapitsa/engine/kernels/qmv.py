"""Quantized mat-vec / small-batch mat-mul: y[M, N] = x[M, K] @ W[N, K]^T for M <= 16.

One warp per output row streams the row's packed weights once for all M input rows (so a
speculative verify of M tokens costs one read of the weights). Affine formats are MLX's
(`mx.quantize`: values packed little-endian in uint32, scale and bias per group); fp4 formats are
e2m1 with a per-group power-of-two (mxfp4, group 32) or e4m3 (nvfp4, group 16) scale.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from kapitsa.engine.kernels import backend

MAX_ROWS = 16
AFFINE_BITS = (2, 3, 4, 6, 8)


def qmv_reference(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    *,
    group_size: int,
    bits: int,
    mode: str = "affine",
) -> mx.array:
    """Plain MLX ops. Shapes: x [M, K], w [N, K*bits/32] uint32, scales/biases [N, K/group] -> [M, N]."""
    weights = mx.dequantize(w, scales, biases, group_size=group_size, bits=bits, mode=mode)
    return (x.astype(mx.float32) @ weights.astype(mx.float32).T).astype(x.dtype)


_HEADER = r"""
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
"""

# Each lane handles 32-value chunks: BITS consecutive uint32 words of the row's bit stream.
_SOURCE = r"""
  constexpr int WORDS_PER_CHUNK = BITS;           // 32 values * BITS bits / 32
  constexpr int CHUNKS = K / 32;
  constexpr int GROUPS = K / GS;
  const int lane = threadIdx.x & 31;
  const int row = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  if (row >= N) return;
  const uint32_t* wrow = w + (size_t)row * (K / 32 * BITS);
  float acc[M];
  #pragma unroll
  for (int m = 0; m < M; ++m) acc[m] = 0.f;
  for (int c = lane; c < CHUNKS; c += 32) {
    uint32_t words[WORDS_PER_CHUNK];
    #pragma unroll
    for (int i = 0; i < WORDS_PER_CHUNK; ++i) words[i] = wrow[c * WORDS_PER_CHUNK + i];
    // A chunk holds 32 / SUB groups' worth of values (SUB = 16 for nvfp4, else 32).
    constexpr int SUB = GS < 32 ? GS : 32;
    #pragma unroll
    for (int part = 0; part < 32 / SUB; ++part) {
      const int g = (c * 32 + part * SUB) / GS;
      float scale, bias = 0.f;
      if (MODE == 0) { scale = (float)scales[row * GROUPS + g]; bias = (float)biases[row * GROUPS + g]; }
      else if (MODE == 1) { scale = ldexpf(1.f, (int)((const uint8_t*)scales)[row * GROUPS + g] - 127); }
      else { scale = kq_e4m3(((const uint8_t*)scales)[row * GROUPS + g]); }
      float dot[M], xs[M];
      #pragma unroll
      for (int m = 0; m < M; ++m) { dot[m] = 0.f; xs[m] = 0.f; }
      #pragma unroll
      for (int jj = 0; jj < SUB; ++jj) {
        const int j = part * SUB + jj;
        const int off = j * BITS, wi = off >> 5, sh = off & 31;
        uint32_t q = words[wi] >> sh;
        if (sh + BITS > 32) q |= words[wi + 1] << (32 - sh);
        q &= (1u << BITS) - 1u;
        const float qv = MODE == 0 ? (float)q : kq_e2m1(q);
        #pragma unroll
        for (int m = 0; m < M; ++m) {
          const float xv = (float)x[m * K + c * 32 + j];
          dot[m] += qv * xv;
          xs[m] += xv;
        }
      }
      #pragma unroll
      for (int m = 0; m < M; ++m) acc[m] += scale * dot[m] + bias * xs[m];
    }
  }
  #pragma unroll
  for (int m = 0; m < M; ++m) {
    float v = acc[m];
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    if (lane == 0) y[m * N + row] = (T)v;
  }
"""

_MODES = {"affine": 0, "mxfp4": 1, "nvfp4": 2}


@functools.cache
def _cuda_kernel(mode: int):
    return mx.fast.cuda_kernel(
        name=f"kapitsa_qmv_m{mode}",
        input_names=["x", "w", "scales", "biases"],
        output_names=["y"],
        source=_SOURCE,
        header=_HEADER,
    )


def supports(x: mx.array, *, group_size: int, bits: int, mode: str) -> bool:
    if backend() != "cuda" or x.ndim != 2 or x.shape[0] > MAX_ROWS or mode not in _MODES:
        return False
    if mode == "affine":
        return bits in AFFINE_BITS and group_size % 32 == 0
    return bits == 4 and x.shape[1] % 32 == 0 and group_size in (16, 32)


def qmv(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    *,
    group_size: int,
    bits: int,
    mode: str = "affine",
) -> mx.array:
    """x [M, K] @ dequantize(w)[N, K]^T -> [M, N], through the kernel when the backend has one."""
    if not supports(x, group_size=group_size, bits=bits, mode=mode):
        return qmv_reference(x, w, scales, biases, group_size=group_size, bits=bits, mode=mode)
    rows, k = x.shape
    n = w.shape[0]
    mode_id = _MODES[mode]
    # fp4 modes have no bias; a one-element stand-in keeps one kernel signature for every mode.
    inputs = [x, w, scales, biases if mode_id == 0 else mx.zeros((1,), x.dtype)]
    return _cuda_kernel(mode_id)(
        inputs=inputs,
        template=[
            ("T", x.dtype),
            ("M", rows),
            ("N", n),
            ("K", k),
            ("GS", group_size),
            ("BITS", bits),
            ("MODE", mode_id),
        ],
        grid=(n * 32, 1, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[(rows, n)],
        output_dtypes=[x.dtype],
    )[0]
