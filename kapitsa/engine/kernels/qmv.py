"""Quantized mat-vec / small-batch mat-mul: y[M, N] = x[M, K] @ W[N, K]^T for M <= 16.

`qmv` is the entry point: it runs the kernel that the measured table CUDA_ROUTES names (v2 in
qmv_fast.py / qmv_mma.py for affine 4/8-bit at 1-8 rows, this file's v1 otherwise), or the
reference. The rest of this file is v1: one warp per output row streams the row's packed weights
once for all M input rows (so a speculative verify of M tokens costs one read of the weights).
Affine formats are MLX's (`mx.quantize`: values packed little-endian in uint32, scale and bias per
group); fp4 formats are e2m1 with a per-group power-of-two (mxfp4, group 32) or e4m3 (nvfp4,
group 16) scale.
"""

from __future__ import annotations

import mlx.core as mx

from kapitsa.engine.kernels import backend
from kapitsa.engine.kernels.cuda import CudaKernel, read_cuda_source
from kapitsa.engine.kernels.qmv_fast import qmv_fast, supports_fast
from kapitsa.engine.kernels.qmv_mma import qmv_mma, supports_mma

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


# v1's CUDA source: cuda_src/qmv.cu, its fp4/e4m3 decoders in qmv.cuh.
# A block of WARPS warps handles WARPS output rows. x is staged tile by tile in shared memory as
# float, padded to 33 floats per 32 values so lane l reading its chunk hits bank (l + j) % 32.
# Each lane owns 32-value chunks: BITS consecutive uint32 words of the row's bit stream, loaded
# with 16-byte loads when BITS is a multiple of 4.
WARPS = 8
SHARED_BYTES = 40 * 1024  # stays under the 48 KiB available without an opt-in


def _tile_for(rows: int) -> int:
    """Largest multiple of 32 values whose padded x tile for `rows` rows fits SHARED_BYTES."""
    per_value = rows * 4 * 33 / 32
    return max(32, int(SHARED_BYTES / per_value) // 32 * 32)


_MODES = {"affine": 0, "mxfp4": 1, "nvfp4": 2}


def _kernel(mode: int) -> CudaKernel:
    return CudaKernel(
        name=f"kapitsa_qmv_m{mode}",
        input_names=("x", "w", "scales", "biases"),
        output_names=("y",),
        source=read_cuda_source("qmv.cu"),
        header=read_cuda_source("qmv.cuh"),
    )


def launch_template(x: mx.array, n: int, *, group_size: int, bits: int, mode_id: int) -> tuple[list, int]:
    """(template arguments, shared memory bytes) for one call."""
    rows, k = x.shape
    tile = min(_tile_for(rows), k)
    template = [
        ("T", x.dtype),
        ("M", rows),
        ("N", n),
        ("K", k),
        ("GS", group_size),
        ("BITS", bits),
        ("MODE", mode_id),
        ("TILE", tile),
        ("WARPS", WARPS),
    ]
    return template, rows * (tile // 32) * 33 * 4


def supports(x: mx.array, *, group_size: int, bits: int, mode: str) -> bool:
    """Whether the custom kernel can run this call (right backend, shapes and format)."""
    if backend() != "cuda" or x.ndim != 2 or x.shape[0] > MAX_ROWS or mode not in _MODES:
        return False
    if mode == "affine":
        return bits in AFFINE_BITS and group_size % 32 == 0
    return bits == 4 and x.shape[1] % 32 == 0 and group_size in (16, 32)


# Which implementation serves (mode, bits) -> {rows: "v2mma" | "v2" | "v1"} on CUDA (v2mma: the
# tensor-core variant, bf16/fp16 activations, else v2); anything not listed keeps MLX's stock
# quantized_matmul. Measured on the H200 with lab/kernels_qmv.py (27B chain, which prints the
# table its numbers support); edit it so that a row names a kernel only where it beat stock.
# History (lab/runs/qmv-h200.md): v1 beat stock only for affine 4-bit at 2-8 rows (44 vs 54 ms
# at 4 rows); v2 is the default for affine 4/8-bit at 1-8 rows until its H200 run says otherwise.
CUDA_ROUTES: dict[tuple[str, int], dict[int, str]] = {
    ("affine", 4): {rows: "v2" for rows in range(1, 9)},
    ("affine", 8): {rows: "v2" for rows in range(1, 9)},
}


def route(rows: int, *, bits: int, mode: str) -> str:
    """What CUDA_ROUTES picks for this case: "v2mma", "v2", "v1" or "stock"."""
    return CUDA_ROUTES.get((mode, bits), {}).get(rows, "stock")


def prefer_kernel(rows: int, *, bits: int, mode: str) -> bool:
    """Whether a model should call `qmv` instead of MLX's stock quantized_matmul: only on CUDA,
    where CUDA_ROUTES says a kernel beat stock on the H200 (Metal is unmeasured)."""
    return backend() == "cuda" and route(rows, bits=bits, mode=mode) != "stock"


def qmv_v1(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    *,
    group_size: int,
    bits: int,
    mode: str = "affine",
) -> mx.array:
    """The first kernel (one warp per output row), for any format `supports` accepts."""
    rows = x.shape[0]
    n = w.shape[0]
    mode_id = _MODES[mode]
    # fp4 modes have no bias; a one-element stand-in keeps one kernel signature for every mode.
    inputs = [x, w, scales, biases if mode_id == 0 else mx.zeros((1,), x.dtype)]
    template, shared_bytes = launch_template(x, n, group_size=group_size, bits=bits, mode_id=mode_id)
    blocks = (n + WARPS - 1) // WARPS
    return _kernel(mode_id)(
        inputs,
        template=template,
        grid=(blocks * WARPS * 32, 1, 1),
        threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(rows, n)],
        output_dtypes=[x.dtype],
        shared_memory=shared_bytes,
    )[0]


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
    """x [M, K] @ dequantize(w)[N, K]^T -> [M, N], through a kernel when the backend has one.

    CUDA: what CUDA_ROUTES names where it supports the call (v2mma = qmv_mma, else v2 =
    qmv_fast), else v1, else the reference. Metal: the v2 port where it supports the call
    (unmeasured, so `prefer_kernel` keeps models on the stock op there), else the reference."""
    rows = x.shape[0] if x.ndim == 2 else 0
    choice = route(rows, bits=bits, mode=mode)
    fast = mode == "affine" and supports_fast(x, w, scales, biases, group_size=group_size, bits=bits)
    if fast and choice == "v2mma" and supports_mma(x, w, scales, biases, group_size=group_size, bits=bits):
        return qmv_mma(x, w, scales, biases, group_size=group_size, bits=bits)
    if fast and (backend() == "metal" or choice in ("v2", "v2mma")):
        return qmv_fast(x, w, scales, biases, group_size=group_size, bits=bits)
    if supports(x, group_size=group_size, bits=bits, mode=mode):
        return qmv_v1(x, w, scales, biases, group_size=group_size, bits=bits, mode=mode)
    return qmv_reference(x, w, scales, biases, group_size=group_size, bits=bits, mode=mode)
