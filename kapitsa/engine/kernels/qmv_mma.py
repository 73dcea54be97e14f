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
from kapitsa.engine.kernels.cuda import CudaKernel, read_cuda_source
from kapitsa.engine.kernels.qmv_fast import supports_fast

# cuda_src/qmv_mma.cu; qmv_mma.cuh holds the mma.sync wrappers and the pair dequantizers.
_MMA_KERNEL = CudaKernel(
    name="kapitsa_qmv_mma",
    input_names=("x", "w", "scales", "biases"),
    output_names=("y",),
    source=read_cuda_source("qmv_mma.cu"),
    header=read_cuda_source("qmv_mma.cuh"),
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
