"""Quantized mat-vec v3 ("direct"): y[M, N] = x[M, K] @ dequantize(W)[N, K]^T for M <= 8, MLX
affine 4/8-bit weights, group size 32/64/128, bf16/fp16/fp32 activations.

v2 (qmv_fast.py) stages x in shared memory before a block streams any weight past its first
chunk; at batch 1 a block of a 27B mat-vec lives only a few microseconds, so that staging is on
the critical path of every block. This kernel has no shared memory: x (a few KiB, read by every
warp on the SM) comes through L1, and each lane issues the weight loads of UNROLL rounds at once
(R rows x UNROLL 16-byte loads in flight) before it computes any. Each warp owns R output rows and
each lane the same chunks of K in all of them, so one x load serves R rows. Dequantisation is
v2's (qmv_fast.cuh): a masked field OR'ed into the mantissa of 2^23 and one FMA give q exactly;
the group bias enters as bias * sum(x) per chunk.
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx

from kapitsa.engine.kernels import backend
from kapitsa.engine.kernels.cuda import CudaKernel, read_cuda_source
from kapitsa.engine.kernels.qmv_fast import MAX_ROWS, supported_affine

_KERNEL = CudaKernel(
    name="kapitsa_qmv_direct",
    input_names=("x", "w", "scales", "biases"),
    output_names=("y",),
    source=read_cuda_source("qmv_direct.cu"),
    header=read_cuda_source("qmv_fast.cuh"),
)

# (rows per warp, warps per block, rounds unrolled) by number of input rows. Registers: about
# R * UNROLL * 6 for the loads in flight plus R * M accumulators.
SHAPE_BY_ROWS = {m: (2, 4, 4) for m in range(1, MAX_ROWS + 1)}


@functools.cache  # called per mat-vec of every decode step: keep the host work to a dict lookup
def launch_config(
    dtype, rows: int, n: int, k: int, group_size: int, bits: int, shape
) -> tuple[tuple, int, int]:
    """(template arguments, grid threads, block threads) for one call."""
    r, warps, unroll = shape
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
    )
    blocks = math.ceil(n / (r * warps))
    return template, blocks * warps * 32, warps * 32


def supports_direct(
    x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None, *, group_size: int, bits: int
) -> bool:
    """Whether this kernel can run the call here: CUDA, and the calls v2 takes (`supported_affine`)."""
    return backend() == "cuda" and supported_affine(x, w, scales, biases, group_size, bits)


def qmv_direct(
    x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, *, group_size: int, bits: int, shape=None
) -> mx.array:
    """x [M, K] @ dequantize(w)[N, K]^T -> [M, N] in x's dtype. Callers check `supports_direct`."""
    rows, k = x.shape
    n = w.shape[0]
    shape = SHAPE_BY_ROWS[rows] if shape is None else shape
    template, grid, block = launch_config(x.dtype, rows, n, k, group_size, bits, shape)
    return _KERNEL(
        [x, w, scales, biases],
        template=template,
        grid=(grid, 1, 1),
        threadgroup=(block, 1, 1),
        output_shapes=[(rows, n)],
        output_dtypes=[x.dtype],
    )[0]
