"""Quantized mat-vec for one input row: y[M, N] = x[M, K] @ dequantize(W)[N, K]^T (M <= 8 runs,
the routes give it M = 1), MLX affine 4/8-bit weights, group size 32/64/128, bf16/fp16/fp32
activations, CUDA only.

At batch 1 a block of a 27B mat-vec lives only a few microseconds, so staging x in shared memory
(the general kernel, matvec.py) sits on the critical path of every block. This kernel has no
shared memory: x (a few KiB, read by every warp on the SM) comes through L1, and each lane issues
the weight loads of UNROLL rounds at once (R rows x UNROLL 16-byte loads in flight) before it
computes any. Each warp owns R output rows and each lane the same chunks of K in all of them, so
one x load serves R rows. Dequantisation is the general kernel's (cuda_src/matvec.cuh): a masked
field OR'ed into the mantissa of 2^23 and one FMA give q exactly; the group bias enters as
bias * sum(x) per chunk.

The same kernel can fuse the RMSNorm before a projection and the residual add after it
(`norm=(weight, eps)`, `residual=`), an input activation (`act=`) and a SwiGLU epilogue
(`glu=`), so a decode layer's norms and adds cost no kernels of their own: the sum of squares
comes from the x loads the product makes anyway, the 1/rms scalar is applied after the
reduction, and the residual is added in the epilogue. `qmv_one_row_reference` is the same
computation in MLX ops.
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx
import mlx.nn as nn

from kapitsa.engine.kernels import backend, float_bits
from kapitsa.engine.kernels.cuda import CudaKernel, read_cuda_source
from kapitsa.engine.kernels.matvec import MAX_ROWS, qmv_reference, rows_and_k, supported_affine

ACTS = (None, "silu_glu", "relu2")  # the kernel's ACT codes: input activations made on load

_KERNEL = CudaKernel(
    name="kapitsa_matvec_one_row",
    input_names=("x", "w", "scales", "biases", "nw", "res"),
    output_names=("y",),
    source=read_cuda_source("matvec_one_row.cu"),
    header=read_cuda_source("matvec.cuh"),
)

# (rows per warp, warps per block, rounds unrolled) by number of input rows. Registers: about
# R * UNROLL * 6 for the loads in flight plus R * M accumulators. One row: (4, 4, 2), the fastest
# of the launch shapes lab/host_costs.py times over the Qwen3.5-27B's fused mat-vec chain on the
# H200 (ptxas: 88-96 registers, no spills). Four rows per warp also halve, per weight, the x-side
# work of the fused norm prologue, which each warp does once for all its rows.
SHAPE_BY_ROWS = {m: (4, 4, 2) if m == 1 else (2, 4, 4) for m in range(1, MAX_ROWS + 1)}


@functools.cache  # called per mat-vec of every decode step: keep the host work to a dict lookup
def launch_config(
    dtype,
    rows: int,
    n: int,
    k: int,
    group_size: int,
    bits: int,
    shape,
    eps: float | None = None,
    resid: bool = False,
    act: str | None = None,
    glu: bool = False,
) -> tuple[tuple, int, int]:
    """(template arguments, grid threads, block threads) for one call; `eps` set: RMSNorm fused.
    `shape`: (rows per warp, warps per block, rounds unrolled[, pipelined[, persistent blocks]]) -
    pipelined unrolls the loop over round groups completely, so one group's loads may overlap the
    previous one's math; persistent blocks > 0 caps the grid at that many blocks, each warp then
    looping over every (blocks * warps)-th group of rows."""
    r, warps, unroll, *rest = shape
    pipelined = bool(rest and rest[0])
    tasks_blocks = math.ceil(n / (r * warps))  # (with glu: n / 2 columns, r / 2 per warp)
    persist = int(rest[1]) if len(rest) > 1 and rest[1] and rest[1] < tasks_blocks else 0
    template = (
        ("T", dtype),
        ("M", rows),
        ("N", n),
        ("K", k),
        ("GS", group_size),
        ("BITS", bits),
        ("R", r),
        ("WARPS", warps),
        ("UNROLL", unroll),
        ("NORM", eps is not None),
        ("RESID", resid),
        ("EPS_BITS", float_bits(eps or 0.0)),
        ("ACT", ACTS.index(act)),
        ("PIPELINE", pipelined),
        ("PERSIST_BLOCKS", persist),
        ("GLU", glu),
    )
    blocks = persist or tasks_blocks
    return template, blocks * warps * 32, warps * 32


def supports_one_row(
    x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None, *, group_size: int, bits: int
) -> bool:
    """Whether this kernel can run the call here: CUDA, and the calls `supported_affine` accepts."""
    return backend() == "cuda" and supported_affine(x, w, scales, biases, group_size, bits)


def supports_fused(x: mx.array, n: int, norm_weight: mx.array | None, residual: mx.array | None) -> bool:
    """Whether the norm weight ([K], x's dtype) and residual ([..., N] like x's rows, x's dtype) fit a call."""
    k = x.shape[-1]
    return (norm_weight is None or (norm_weight.shape == (k,) and norm_weight.dtype == x.dtype)) and (
        residual is None or (residual.shape == (*x.shape[:-1], n) and residual.dtype == x.dtype)
    )


def qmv_one_row(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    *,
    group_size: int,
    bits: int,
    shape=None,
    norm: tuple[mx.array, float] | None = None,
    residual: mx.array | None = None,
    act: str | None = None,
    glu: bool = False,
) -> mx.array:
    """[residual +] [RMSNorm(x; norm) | act(x)] @ dequantize(w)[N, K]^T -> [..., N] in x's dtype,
    x [..., K] with M rows ([..., 2K] for act "silu_glu": gate then up; residual [..., N]).
    Callers check `supports_one_row` (on the product's input shape) and `supports_fused` for norm /
    residual; norm and act exclude each other.
    `glu`: w's rows are [gate | up] and the result is silu(gate) * up, `[..., N / 2]` (made from
    the float32 products; an even row count per warp, no residual)."""
    if norm is not None and act is not None:
        raise ValueError("qmv_one_row fuses a norm or an activation before the product, not both")
    if glu and (residual is not None or w.shape[0] % 2):
        raise ValueError("qmv_one_row's glu epilogue takes an even number of weight rows and no residual")
    rows, k = rows_and_k(x)
    k = k // 2 if act == "silu_glu" else k
    n = w.shape[0]
    shape = SHAPE_BY_ROWS[rows] if shape is None else shape
    if glu and shape[0] % 2:
        raise ValueError(f"qmv_one_row's glu epilogue needs an even number of rows per warp, not {shape[0]}")
    eps = None if norm is None else float(norm[1])
    template, grid, block = launch_config(
        x.dtype, rows, n, k, group_size, bits, shape, eps, residual is not None, act, glu
    )
    return _KERNEL(
        [x, w, scales, biases, x if norm is None else norm[0], x if residual is None else residual],
        template=template,
        grid=(grid, 1, 1),
        threadgroup=(block, 1, 1),
        output_shapes=[(*x.shape[:-1], n // 2 if glu else n)],
        output_dtypes=[x.dtype],
    )[0]


def qmv_one_row_reference(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    *,
    group_size: int,
    bits: int,
    norm: tuple[mx.array, float] | None = None,
    residual: mx.array | None = None,
    act: str | None = None,
    glu: bool = False,
) -> mx.array:
    """What `qmv_one_row` computes, in MLX ops (the norm and activations in float32)."""
    dtype = x.dtype
    x = activation(act, x.astype(mx.float32)) if act is not None else x
    if norm is not None:
        x = mx.fast.rms_norm(x.astype(mx.float32), norm[0].astype(mx.float32), norm[1])
    f32 = mx.float32  # the kernel dequantizes in float32 too
    y = qmv_reference(
        x.astype(f32), w, scales.astype(f32), biases.astype(f32), group_size=group_size, bits=bits
    )
    if glu:
        y = activation("silu_glu", y)
    if residual is not None:
        y = y + residual.astype(mx.float32)
    return y.astype(dtype)


def activation(act: str, x: mx.array) -> mx.array:
    """The input activations the kernel can make on load, in MLX ops (`ACTS`)."""
    if act == "silu_glu":
        gate, up = mx.split(x, 2, axis=-1)
        return nn.silu(gate) * up
    if act == "relu2":
        return mx.square(nn.relu(x))
    raise ValueError(f"unknown activation {act!r}; one of {ACTS[1:]}")
