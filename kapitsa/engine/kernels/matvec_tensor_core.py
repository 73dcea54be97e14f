"""Quantized mat-vec on tensor cores: y[M, N] = x[M, K] @ dequantize(W)[N, K]^T for M <= 16 rows
of bf16 x and MLX affine 4-bit weights (group size 64 or 128), CUDA only.

The routes (kapitsa/engine/ops/linear.py) give it the 2-16 row calls: speculative verification,
where the rows share one read of the weights. Why: Nsight Compute on the H200 shows the SIMT
mat-vecs (matvec.py, matvec_one_row.py) at a 27B gate/up shape issue-bound, not memory-bound (SM
throughput 72%, DRAM 36%): about 3.6 instructions per weight (mask, FMA to the integer, FMA with
x, x conversion). Here a weight costs about one: two nibbles become a bf16 pair with one shift and
one LOP3, and `mma.m16n8k16` does the multiply-adds, 16 rows by up to 8 x rows at a time; 9-16 x
rows take a second block of 8 columns, which reuses each weight fragment. Large-K, small-N
matrices (the down projection) also split K over S warps of a block, so they have enough warps in
flight to reach the bandwidth.

The CUDA source is cuda_src/matvec_tensor_core.cu (+ .cuh); its layout notes are there. No Metal
port: Apple GPUs have no `mma.sync` (simdgroup matrices are a different design), so Macs keep the
stock path.
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx

from kapitsa.engine.kernels import backend
from kapitsa.engine.kernels.cuda import CudaKernel, read_cuda_source
from kapitsa.engine.kernels.matvec import rows_and_k, supported_affine

GROUP_SIZES = (64, 128)
MAX_ROWS = 16  # two 8-column blocks of B
WARPS = 8
TARGET_WARPS = 132 * 12  # about 12 warps per SM of the H200 keep its memory busy

TILES = 2  # 16-row tiles of W per warp (they share each x fragment)
# A holds q itself (128 subtracted from each bf16 pair 128 + q) rather than 128 + q, so the MMA
# sums never carry the 128 * x offset that the group term would then cancel
# (cuda_src/matvec_tensor_core.cu).
EXACT_Q = True

_KERNEL = CudaKernel(
    name="kapitsa_matvec_tensor_core",
    input_names=("x", "w", "scales", "biases"),
    output_names=("y",),
    source=read_cuda_source("matvec_tensor_core.cu"),
    header=read_cuda_source("matvec_tensor_core.cuh"),
)


def splits_for(n: int, k: int, group_size: int, tiles: int) -> int:
    """Warps splitting K per 16*tiles-row tile: the fewest (a power of two up to WARPS) that give
    about TARGET_WARPS warps, and never more than the groups in a row."""
    tile_count = math.ceil(n / (16 * tiles))
    s = 1
    while s < WARPS and tile_count * s < TARGET_WARPS and (k // group_size) >= 2 * s:
        s *= 2
    return s


@functools.cache  # called per mat-vec of every decode step: keep the host work to a dict lookup
def launch_config(
    rows: int, n: int, k: int, group_size: int, tiles: int, exact_q: bool
) -> tuple[tuple, int, int]:
    """(template arguments, grid threads, block threads) for one call."""
    s = splits_for(n, k, group_size, tiles)
    spans_per_group = group_size // 64
    blocks_of_x = math.ceil(rows / 8)  # each holds its x loads in flight: fewer groups per round
    template = (
        ("MB", 8 * blocks_of_x),  # rows come from x's shape: 1-8 and 9-16 rows share a compile
        ("N", n),
        ("K", k),
        ("GS", group_size),
        ("TILES", tiles),
        ("WARPS", WARPS),
        ("S", s),
        ("UG", max(1, 4 // spans_per_group // blocks_of_x)),
        ("EXACT_Q", exact_q),
    )
    warps = math.ceil(n / (16 * tiles)) * s
    blocks = math.ceil(warps / WARPS)
    return template, blocks * WARPS * 32, WARPS * 32


def supports_tensor_core(
    x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None, *, group_size: int, bits: int
) -> bool:
    """Whether this kernel can run the call here (CUDA, 1-16 rows of bf16 x, bf16 scales, affine
    4-bit, group 64/128)."""
    return (
        backend() == "cuda"
        and supported_affine(x, w, scales, biases, group_size, bits, max_rows=MAX_ROWS)
        and bits == 4
        and group_size in GROUP_SIZES
        and x.dtype == scales.dtype == biases.dtype == mx.bfloat16
    )


def qmv_tensor_core(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    *,
    group_size: int,
    tiles: int = TILES,
    exact_q: bool = EXACT_Q,
) -> mx.array:
    """x [..., K] bf16 (M rows) @ dequantize(w)[N, K]^T -> [..., N] bf16. Callers check
    `supports_tensor_core`. `tiles` and `exact_q`: other launch variants, for the lab scripts."""
    rows, k = rows_and_k(x)
    n = w.shape[0]
    template, grid, block = launch_config(rows, n, k, group_size, tiles, exact_q)
    return _KERNEL(
        [x, w, scales, biases],  # the kernel reads its row count from x's shape
        template=template,
        grid=(grid, 1, 1),
        threadgroup=(block, 1, 1),
        output_shapes=[(*x.shape[:-1], n)],
        output_dtypes=[mx.bfloat16],
    )[0]
