"""Quantized mat-vec, the general kernel: y[M, N] = x[M, K] @ dequantize(W)[N, K]^T for M <= 8,
MLX affine 4-bit and 8-bit weights, group size 32/64/128, bf16/fp16/fp32 activations, on CUDA
and Metal; plus what every mat-vec kernel shares: `qmv_reference` and the call checks.

The routes (kapitsa/engine/ops/linear.py) give it the 1-8 row calls that the one-row and
tensor-core kernels do not take (8-bit weights, fp32/fp16 activations). Why it is shaped so:
- Each warp computes R output rows and each lane always owns the same 16-byte chunks of K
  (32 values at 4 bits, 16 at 8), so the x values a lane reads from shared memory serve all R
  rows, and a block of WARPS x R rows stages x once.
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
from kapitsa.engine.kernels.cuda import CudaKernel, read_cuda_source
from kapitsa.engine.kernels.metal import MetalKernel

MAX_ROWS = 8
BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
DTYPES = (mx.bfloat16, mx.float16, mx.float32)
SHARED_BUDGET = 44 * 1024  # under the 48 KiB a CUDA kernel gets without an opt-in
METAL_SHARED_BUDGET = 28 * 1024  # Apple GPUs have 32 KiB of threadgroup memory
PAD = 4  # floats after each staged chunk (bank-conflict-free float4 reads)

# cuda_src/matvec_general.cu; matvec.cuh holds the activation loads and weight decoders that the
# one-row kernel shares.
_KERNEL = CudaKernel(
    name="kapitsa_matvec_general",
    input_names=("x", "w", "scales", "biases"),
    output_names=("y",),
    source=read_cuda_source("matvec_general.cu"),
    header=read_cuda_source("matvec.cuh"),
)

# The same algorithm for Apple GPUs (metal/matvec_general.metal, unverified on hardware):
# SMEM_FLOATS sizes its threadgroup array, which Metal declares statically.
_METAL_KERNEL = MetalKernel(
    name="kapitsa_matvec_general",
    filename="matvec_general.metal",
    input_names=("x", "w", "scales", "biases"),
    output_names=("y",),
)

# (rows per warp, warps per block) by number of input rows: the register budget is about
# R * (8 + 2M) floats, and a block keeps ~16 rows so staging x stays a few percent of the work.
_SHAPE_BY_ROWS = {1: (4, 4), 2: (4, 4), 3: (4, 4), 4: (4, 4), 5: (2, 8), 6: (2, 8), 7: (2, 8), 8: (2, 8)}


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
    """What every mat-vec kernel computes, in MLX ops: x [..., K] @ dequantize(w)[N, K]^T ->
    [..., N] in x's dtype, float32 products."""
    weights = mx.dequantize(w, scales, biases, group_size=group_size, bits=bits, mode=mode)
    return (x.astype(mx.float32) @ weights.astype(mx.float32).T).astype(x.dtype)


def rows_and_k(x: mx.array) -> tuple[int, int]:
    """(rows, K) of a mat-vec input `[..., K]`: the kernels read x as rows of K contiguous values,
    so callers pass `[B, T, K]` as it is (a reshape is one more primitive for the host to encode
    on every decode step) and get `[B, T, N]` back."""
    return math.prod(x.shape[:-1]), x.shape[-1]


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
    rows, k = rows_and_k(x)
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


def supports_general(
    x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None, *, group_size: int, bits: int
) -> bool:
    """Whether the general kernel can run this call (CUDA or Metal, affine 4/8-bit, shapes it handles)."""
    if backend() not in ("cuda", "metal") or not supported_affine(x, w, scales, biases, group_size, bits):
        return False
    rows, k = rows_and_k(x)
    # on Metal one round of staged x (32 chunks per row) must fit Apple's 32 KiB
    return backend() == "cuda" or shared_bytes(rows, k, bits, METAL_SHARED_BUDGET) <= METAL_SHARED_BUDGET


def supported_affine(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    group_size: int,
    bits: int,
    max_rows: int = MAX_ROWS,
) -> bool:
    """Whether a call is one the mat-vec kernels take, whatever the backend: x [..., K] with 1 to
    max_rows rows in a float dtype, MLX affine 4/8-bit weights with group size 32/64/128, shapes
    consistent with K."""
    if biases is None or x.ndim < 2 or w.ndim != 2:
        return False
    rows, k = rows_and_k(x)
    return (
        1 <= rows <= max_rows
        and bits in BITS
        and group_size in GROUP_SIZES
        and x.dtype in DTYPES
        and k % group_size == 0
        and w.shape[1] * 32 == k * bits
        and scales.shape == (w.shape[0], k // group_size)
        and biases.shape == scales.shape
    )


def qmv_general(
    x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, *, group_size: int, bits: int
) -> mx.array:
    """x [..., K] @ dequantize(w)[N, K]^T -> [..., N] in x's dtype. Callers check
    `supports_general` first."""
    n = w.shape[0]
    out_shape = (*x.shape[:-1], n)
    if backend() == "metal":
        template, grid, block = metal_launch_config(x, n, group_size=group_size, bits=bits)
        return _METAL_KERNEL(
            [x, w, scales, biases],
            template=template,
            grid=(grid, 1, 1),
            threadgroup=(block, 1, 1),
            output_shapes=[out_shape],
            output_dtypes=[x.dtype],
        )[0]
    template, shared, grid, block = launch_config(x, n, group_size=group_size, bits=bits)
    return _KERNEL(
        [x, w, scales, biases],
        template=template,
        grid=(grid, 1, 1),
        threadgroup=(block, 1, 1),
        output_shapes=[out_shape],
        output_dtypes=[x.dtype],
        shared_memory=shared,
    )[0]
