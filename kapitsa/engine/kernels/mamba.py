"""Fused Mamba-2 step for Nemotron-H: conv + SiLU, dt, the SSM update over T tokens, D skip, and
the group-gated RMS output norm, for decode (T = 1) and speculative verification (T <= 64).

Shapes: conv_in `[B, K-1+T, C]` (conv rows, then the new rows; C = H*P + 2*G*N, channels x, B, C),
conv_weight `[C, K, 1]`, conv_bias `[C]` or None, dt `[B, T, H]` (raw, before softplus),
dt_bias / A_log / D `[H]`, gate `[B, T, H*P]`, norm_weight `[H*P]`, state `[B, H, P, N]` float32
or None (zeros), mask `[B, T]` bool or None (False = padding: dt = 0 there, the state is frozen).
Returns (out `[B, T, H*P]` in gate's dtype, new state `[B, H, P, N]` float32).

Two kernels (CUDA here, the same algorithm for Metal in metal/mamba_step.metal):
1. step: one block per (batch row, head, slice of ROWS state rows). Per chunk of up to 16 tokens
   the block computes conv + SiLU of its x channels and of its group's B and C channels into
   shared memory; then each warp advances its 4 state rows (lanes split N with vector loads, the
   state stays in registers across all T tokens) and reduces y = S C over N by warp shuffles.
   It writes y + D x in float32.
2. norm: one block per (row, token, group): y * silu(gate), RMS over the group, times the weight.
The norm is a second kernel because a group spans H/G heads: fusing it would mean one block per
group (8 blocks for the 30B at batch 1, far too few to stream its 2 MiB of state) or a grid sync.

In Mamba2Mixer (chain forwards) one call replaces causal_conv, silu, the split, ssm_dt, ssm_scan
and self.norm; the caller still builds conv_in and the next conv rows (conv_state_after).
"""

from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from kapitsa.engine.kernels import backend
from kapitsa.engine.kernels.cuda import CudaKernel
from kapitsa.engine.kernels.metal import read_source
from kapitsa.engine.ops.conv import causal_conv_reference
from kapitsa.engine.ops.norm import GroupGatedRMSNorm
from kapitsa.engine.ops.ssm import ssm_dt, ssm_scan_reference
from kapitsa.errors import KapitsaError

MAX_TOKENS = 64  # longer runs are prefill, where the chunked SSD scan is the better algorithm
MAX_DIM = 256  # head_dim and state_size: multiples of 32 up to this
MAX_CONV = 8
TOKEN_CHUNK = 16  # most tokens staged in shared memory at a time (bounds it for any T)
# Static shared memory a block may use: CUDA's limit without opt-in; Apple GPUs' threadgroup memory.
SHARED_LIMIT = {"cuda": 48 * 1024, "metal": 32 * 1024}
ROWS_PER_WARP = 4
NORM_THREADS = 256
DTYPES = (mx.bfloat16, mx.float16, mx.float32)
METAL_FILE = "mamba_step.metal"
METAL_NORM_MARKER = "// ---- norm body ----"


@dataclass(frozen=True)
class Dims:
    heads: int
    head_dim: int
    groups: int
    state_size: int
    time_step_limit: tuple[float, float]
    norm_eps: float

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim


def mamba_step_reference(
    conv_in, conv_weight, conv_bias, dt, dt_bias, A_log, D, gate, norm_weight, state,
    *, heads, head_dim, groups, state_size, time_step_limit, norm_eps, mask=None,
) -> tuple[mx.array, mx.array]:  # fmt: skip
    """Plain MLX ops: the model's math (Mamba2Mixer.__call__ from conv to norm), step by step."""
    B, T = dt.shape[:2]
    inner = heads * head_dim
    conv_out = causal_conv_reference(conv_in, conv_weight, conv_bias)  # [B, T, C]
    xs, Bm, Cm = mx.split(nn.silu(conv_out), [inner, inner + groups * state_size], axis=-1)
    step = ssm_dt(dt, dt_bias, time_step_limit, mask)  # [B, T, H] float32, 0 on padding
    y, new_state = ssm_scan_reference(
        xs.reshape(B, T, heads, head_dim),  # [B, T, H, P]
        step,
        A_log,
        Bm.reshape(B, T, groups, state_size),  # [B, T, G, N]
        Cm.reshape(B, T, groups, state_size),  # [B, T, G, N]
        D,
        state,
    )
    norm = GroupGatedRMSNorm(inner, norm_eps, inner // groups)
    norm.weight = norm_weight
    return norm(y.reshape(B, T, inner), gate).astype(gate.dtype), new_state


def mamba_step(
    conv_in, conv_weight, conv_bias, dt, dt_bias, A_log, D, gate, norm_weight, state,
    *, heads, head_dim, groups, state_size, time_step_limit, norm_eps, mask=None,
) -> tuple[mx.array, mx.array]:  # fmt: skip
    """`mamba_step_reference`'s result, through a kernel where `supports` says one runs."""
    dims = Dims(heads, head_dim, groups, state_size, tuple(time_step_limit), norm_eps)
    if state is None:
        state = mx.zeros((conv_in.shape[0], heads, head_dim, state_size), mx.float32)
    args = (conv_in, conv_weight, conv_bias, dt, dt_bias, A_log, D, gate, norm_weight, state)
    check_shapes(*args, dims, mask)
    if not supports(
        conv_in, conv_weight, head_dim=head_dim, state_size=state_size, time_step_limit=dims.time_step_limit
    ):
        return mamba_step_reference(*args, **dims.__dict__, mask=mask)
    kernels = cuda_kernels() if backend() == "cuda" else metal_kernels()
    return _launch(kernels, *args, dims, mask)


def check_shapes(
    conv_in, conv_weight, conv_bias, dt, dt_bias, A_log, D, gate, norm_weight, state, dims, mask
):
    """Raise KapitsaError naming the first argument whose shape disagrees with the others."""
    H, P, G, N = dims.heads, dims.head_dim, dims.groups, dims.state_size
    if min(H, P, G, N) <= 0 or H % G:
        raise KapitsaError(
            f"mamba_step: heads, head_dim, groups, state_size must be positive and heads a multiple "
            f"of groups, got H={H}, P={P}, G={G}, N={N}"
        )
    if conv_in.ndim != 3 or conv_weight.ndim != 3 or dt.ndim != 3:
        raise KapitsaError(
            f"mamba_step: conv_in, conv_weight and dt must be 3-D, got {conv_in.shape}, "
            f"{conv_weight.shape}, {dt.shape}"
        )
    B, T, C, K = dt.shape[0], dt.shape[1], H * P + 2 * G * N, conv_weight.shape[1]
    expected = {
        "conv_in": (conv_in, (B, K - 1 + T, C)),
        "conv_weight": (conv_weight, (C, K, 1)),
        "conv_bias": (conv_bias, (C,)),
        "dt": (dt, (B, max(T, 1), H)),
        "dt_bias": (dt_bias, (H,)),
        "A_log": (A_log, (H,)),
        "D": (D, (H,)),
        "gate": (gate, (B, T, H * P)),
        "norm_weight": (norm_weight, (H * P,)),
        "state": (state, (B, H, P, N)),
        "mask": (mask, (B, T)),
    }
    for name, (array, shape) in expected.items():
        if array is not None and tuple(array.shape) != shape:
            raise KapitsaError(
                f"mamba_step: {name} has shape {tuple(array.shape)}, expected {shape} "
                f"(B={B}, T={T}, K={K}, C={C}, H={H}, P={P}, G={G}, N={N})"
            )


def supports(
    conv_in: mx.array,
    conv_weight: mx.array,
    *,
    head_dim: int,
    state_size: int,
    time_step_limit: tuple[float, float] = (0.0, math.inf),
) -> bool:
    """Whether a kernel runs this call on this backend (otherwise `mamba_step` uses the reference)."""
    if backend() not in ("cuda", "metal") or conv_in.dtype not in DTYPES:
        return False
    K = conv_weight.shape[1]
    tokens = conv_in.shape[1] - (K - 1)
    dims_ok = all(d % 32 == 0 and 32 <= d <= MAX_DIM for d in (head_dim, state_size))
    return dims_ok and 1 <= tokens <= MAX_TOKENS and 2 <= K <= MAX_CONV and time_step_limit[1] > 0


# -- launch parameters (shared by CUDA and Metal) ------------------------------------------------


def float_bits(value: float) -> int:
    """A float32's bit pattern as an int, so a float can travel as an integer template argument."""
    return struct.unpack("<i", struct.pack("<f", value))[0]


def rows_per_block(tokens: int) -> int:
    """State rows per block: 16 for short runs (more blocks at batch 1); 32 for longer ones, where
    every block recomputing its group's B/C conv for T tokens starts to cost real L2 traffic."""
    return 16 if tokens <= 4 else 32


def shared_bytes(chunk: int, rows: int, state_size: int) -> int:
    """The step kernel's shared arrays: B and C rows, x and y rows, dt and decay, per token."""
    return chunk * (2 * state_size + 2 * rows + 2) * 4


def token_chunk(tokens: int, rows: int, state_size: int, limit: int) -> int:
    """Tokens per shared-memory chunk: up to TOKEN_CHUNK, fewer where the arrays would not fit."""
    chunk = min(tokens, TOKEN_CHUNK)
    while chunk > 1 and shared_bytes(chunk, rows, state_size) > limit:
        chunk -= 1
    return chunk


def step_template(
    tokens: int, conv_kernel: int, dims: Dims, *, has_bias: bool, has_mask: bool, which: str = "cuda"
) -> list:
    rows = rows_per_block(tokens)
    lo, hi = dims.time_step_limit
    return [
        ("TOKENS", tokens),
        ("TC", token_chunk(tokens, rows, dims.state_size, SHARED_LIMIT[which])),
        ("K", conv_kernel),
        ("H", dims.heads),
        ("P", dims.head_dim),
        ("G", dims.groups),
        ("N", dims.state_size),
        ("ROWS", rows),
        ("WARPS", rows // ROWS_PER_WARP),
        ("HAS_BIAS", has_bias),
        ("HAS_MASK", has_mask),
        # softplus is > 0, so a lower limit <= 0 never binds; 0 keeps the bit pattern non-negative
        ("LO_BITS", float_bits(max(lo, 0.0))),
        ("HI_BITS", float_bits(hi)),
    ]


def norm_template(out_dtype: mx.Dtype, dims: Dims) -> list:
    return [
        ("OutT", out_dtype),
        ("INNER", dims.inner),
        ("GS", dims.inner // dims.groups),
        ("EPS_BITS", float_bits(dims.norm_eps)),
        ("THREADS", NORM_THREADS),
    ]


STEP_INPUTS = ("conv_in", "conv_w", "conv_b", "dt_raw", "dt_bias", "a_log", "d_skip", "state_in", "mask")
STEP_OUTPUTS = ("y", "state_out")
NORM_INPUTS = ("y", "gate", "norm_w")
NORM_OUTPUTS = ("out",)


@functools.cache
def _stand_in(dtype: mx.Dtype) -> mx.array:
    """One element in place of an absent optional input (no conv bias, no mask), so the kernel
    signature never changes; made once per dtype rather than once per call."""
    array = mx.zeros((1,), dtype)
    mx.eval(array)
    return array


def _launch(kernels, conv_in, conv_w, conv_b, dt, dt_bias, A_log, D, gate, norm_w, state, dims, mask):
    step_kernel, norm_kernel = kernels
    B, T = dt.shape[:2]
    H, P = dims.heads, dims.head_dim
    template = step_template(
        T, conv_w.shape[1], dims, has_bias=conv_b is not None, has_mask=mask is not None, which=backend()
    )
    rows = rows_per_block(T)
    threads = rows // ROWS_PER_WARP * 32
    conv_b = conv_b if conv_b is not None else _stand_in(conv_in.dtype)
    mask = mask.astype(mx.bool_) if mask is not None else _stand_in(mx.bool_)
    inputs = [conv_in, conv_w, conv_b, dt, dt_bias, A_log, D, state.astype(mx.float32), mask]
    y, new_state = step_kernel(
        inputs,
        template=template,
        grid=(threads * (P // rows), H, B),
        threadgroup=(threads, 1, 1),
        output_shapes=[(B, T, H * P), (B, H, P, dims.state_size)],
        output_dtypes=[mx.float32, mx.float32],
    )
    out = norm_kernel(
        [y, gate, norm_w],
        template=norm_template(gate.dtype, dims),
        grid=(NORM_THREADS * dims.groups, B * T, 1),
        threadgroup=(NORM_THREADS, 1, 1),
        output_shapes=[(B, T, H * P)],
        output_dtypes=[gate.dtype],
    )[0]
    return out, new_state


# -- kernels -------------------------------------------------------------------------------------

_HEADER = r"""
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
"""

# Lane l holds, for each of its warp's RPW state rows, elements n = (j * 32 + l) * VEC + v
# (j < N / (32 VEC), v < VEC): consecutive lanes read consecutive VEC-float vectors.
_STEP_SOURCE = r"""
  constexpr int VEC = N % 128 == 0 ? 4 : (N % 64 == 0 ? 2 : 1);
  constexpr int PER_LANE = N / 32;
  constexpr int RPW = ROWS / WARPS;
  constexpr int INNER = H * P;
  constexpr int C = INNER + 2 * G * N;
  constexpr int LEN = TOKENS + K - 1;
  constexpr int CH = ROWS + 2 * N;  // conv channels one block needs per token: its x rows, B, C
  constexpr int THREADS = WARPS * 32;
  __shared__ __align__(16) float b_s[TC][N];
  __shared__ __align__(16) float c_s[TC][N];
  __shared__ float x_s[TC][ROWS];
  __shared__ float y_s[TC][ROWS];
  __shared__ float dt_s[TC];
  __shared__ float decay_s[TC];
  const int p0 = blockIdx.x * ROWS, h = blockIdx.y, b = blockIdx.z;
  const int g = h / (H / G);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float a = -expf(static_cast<float>(a_log[h]));
  const float d = static_cast<float>(d_skip[h]);
  const float bias_dt = static_cast<float>(dt_bias[h]);
  const float lo = __int_as_float(LO_BITS), hi = __int_as_float(HI_BITS);
  const size_t row0 = ((size_t)(b * H + h) * P + p0 + warp * RPW) * N;
  float s[RPW][PER_LANE];
  #pragma unroll
  for (int r = 0; r < RPW; ++r) {
    #pragma unroll
    for (int j = 0; j < PER_LANE / VEC; ++j)
      km_load<VEC>(state_in + row0 + r * N + (j * 32 + lane) * VEC, &s[r][j * VEC]);
  }
  for (int t0 = 0; t0 < TOKENS; t0 += TC) {
    const int tn = min(TC, TOKENS - t0);
    __syncthreads();  // the previous chunk's shared rows are no longer read
    for (int i = threadIdx.x; i < tn * CH; i += THREADS) {
      const int tt = i / CH, k = i - tt * CH;
      const int ch = k < ROWS ? h * P + p0 + k
                   : (k < ROWS + N ? INNER + g * N + (k - ROWS) : INNER + (G + g) * N + (k - ROWS - N));
      float acc = HAS_BIAS ? static_cast<float>(conv_b[ch]) : 0.f;
      const size_t src = ((size_t)b * LEN + t0 + tt) * C + ch;
      #pragma unroll
      for (int j = 0; j < K; ++j)
        acc += static_cast<float>(conv_in[src + (size_t)j * C]) * static_cast<float>(conv_w[ch * K + j]);
      const float v = km_silu(acc);
      if (k < ROWS) x_s[tt][k] = v;
      else if (k < ROWS + N) b_s[tt][k - ROWS] = v;
      else c_s[tt][k - ROWS - N] = v;
    }
    if (threadIdx.x < tn) {  // THREADS >= 64 >= TC
      const int t = t0 + threadIdx.x;
      const float raw = static_cast<float>(dt_raw[((size_t)b * TOKENS + t) * H + h]) + bias_dt;
      float v = fminf(fmaxf(km_softplus(raw), lo), hi);
      if (HAS_MASK && !mask[b * TOKENS + t]) v = 0.f;  // padding: decay 1, no input, state frozen
      dt_s[threadIdx.x] = v;
      decay_s[threadIdx.x] = expf(v * a);
    }
    __syncthreads();
    for (int tt = 0; tt < tn; ++tt) {
      const float dtv = dt_s[tt], decay = decay_s[tt];
      float bv[PER_LANE], cv[PER_LANE];
      #pragma unroll
      for (int j = 0; j < PER_LANE / VEC; ++j) {
        km_load<VEC>(&b_s[tt][(j * 32 + lane) * VEC], &bv[j * VEC]);
        km_load<VEC>(&c_s[tt][(j * 32 + lane) * VEC], &cv[j * VEC]);
      }
      #pragma unroll
      for (int r = 0; r < RPW; ++r) {
        const float xv = x_s[tt][warp * RPW + r];
        const float inject = dtv * xv;
        float acc = 0.f;
        #pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
          s[r][i] = fmaf(s[r][i], decay, inject * bv[i]);
          acc = fmaf(s[r][i], cv[i], acc);
        }
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (lane == 0) y_s[tt][warp * RPW + r] = fmaf(d, xv, acc);
      }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < tn * ROWS; i += THREADS) {
      const int tt = i / ROWS, r = i - tt * ROWS;
      y[((size_t)b * TOKENS + t0 + tt) * INNER + h * P + p0 + r] = y_s[tt][r];
    }
  }
  #pragma unroll
  for (int r = 0; r < RPW; ++r) {
    #pragma unroll
    for (int j = 0; j < PER_LANE / VEC; ++j)
      km_store<VEC>(state_out + row0 + r * N + (j * 32 + lane) * VEC, &s[r][j * VEC]);
  }
"""

# One block per (group, row * T + token); the group's GS values are contiguous.
_NORM_SOURCE = r"""
  __shared__ float partial[32];
  __shared__ float total;
  const int grp = blockIdx.x;
  const size_t base = (size_t)blockIdx.y * INNER + (size_t)grp * GS;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float ss = 0.f;
  for (int i = threadIdx.x; i < GS; i += THREADS) {
    const float v = y[base + i] * km_silu(static_cast<float>(gate[base + i]));
    ss += v * v;
  }
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if (lane == 0) partial[warp] = ss;
  __syncthreads();
  if (warp == 0) {
    float v = lane < THREADS / 32 ? partial[lane] : 0.f;
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) total = v;
  }
  __syncthreads();
  const float scale = rsqrtf(total / GS + __int_as_float(EPS_BITS));
  for (int i = threadIdx.x; i < GS; i += THREADS) {
    const float v = y[base + i] * km_silu(static_cast<float>(gate[base + i]));
    out[base + i] = static_cast<OutT>(v * scale * static_cast<float>(norm_w[grp * GS + i]));
  }
"""


@functools.cache
def cuda_kernels() -> tuple[CudaKernel, CudaKernel]:
    return (
        CudaKernel("kapitsa_mamba_step", STEP_INPUTS, STEP_OUTPUTS, _STEP_SOURCE, _HEADER),
        CudaKernel("kapitsa_mamba_norm", NORM_INPUTS, NORM_OUTPUTS, _NORM_SOURCE, _HEADER),
    )


def metal_sources() -> tuple[str, str, str]:
    """(header, step body, norm body) of metal/mamba_step.metal (two bodies, one file)."""
    header, body = read_source(METAL_FILE)
    if METAL_NORM_MARKER not in body:
        raise ValueError(f"{METAL_FILE} has no '{METAL_NORM_MARKER}' line")
    step, norm = body.split(METAL_NORM_MARKER, 1)
    return header, step, norm


@functools.cache
def metal_kernels():
    header, step, norm = metal_sources()
    step_kernel = mx.fast.metal_kernel(
        name="kapitsa_mamba_step",
        input_names=list(STEP_INPUTS),
        output_names=list(STEP_OUTPUTS),
        source=step,
        header=header,
    )
    norm_kernel = mx.fast.metal_kernel(
        name="kapitsa_mamba_norm",
        input_names=list(NORM_INPUTS),
        output_names=list(NORM_OUTPUTS),
        source=norm,
        header=header,
    )
    return _adapt(step_kernel), _adapt(norm_kernel)


def _adapt(kernel):
    """Give an mx.fast.metal_kernel the call signature of CudaKernel (sequences in, list out)."""

    def call(inputs, *, template, grid, threadgroup, output_shapes, output_dtypes):
        return kernel(
            inputs=list(inputs),
            template=list(template),
            grid=grid,
            threadgroup=threadgroup,
            output_shapes=[tuple(s) for s in output_shapes],
            output_dtypes=list(output_dtypes),
        )

    return call
