"""Quantized mat-vec v4 ("stream"): y[M, N] = x[M, K] @ dequantize(W)[N, K]^T for M <= 8 rows of
bf16 x and MLX affine 4-bit weights (group size 32/64/128), CUDA only; it can fuse the RMSNorm
before the product and the residual add after it, like the direct kernel.

Why another one: the direct kernel (qmv_direct.py) streamed the Qwen3.5-27B's one-row chain at
~1.6 TB/s against ~3 TB/s for a kernel that only reads the same bytes. Its warps issue a round of
loads, wait for them, then compute, so a warp has bytes in flight only part of the time, and the
loads in flight are bounded by registers; at ~4 instructions per weight it also competes for
issue slots. The tensor-core kernel (qmv_tc.py) costs about one instruction per weight, but has
the same load-then-wait rhythm. Here each warp keeps STAGES - 1 stages of its weights in flight
through cp.async into a shared-memory ring (no registers held) while it computes the oldest
stage with qmv_tc's MMA math; ldmatrix hands each lane its words of the stage.

The source is cuda_src/qmv_stream.cu (+ qmv_stream.cuh, qmv_tc.cuh); `qmv_direct_reference` is
the same computation in MLX ops (norm and residual included). No Metal port: it is built on
cp.async, ldmatrix and mma.sync.
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx

from kapitsa.engine.kernels import backend, float_bits
from kapitsa.engine.kernels.cuda import CudaKernel, read_cuda_source
from kapitsa.engine.kernels.qmv_fast import rows_and_k, supported_affine

MAX_ROWS = 8  # one 8-column block of B
WARPS = 4
TARGET_WARPS = 132 * 12  # about 12 warps per SM of the H200 (the split heuristic's aim)
IN_FLIGHT_BYTES = 12 * 1024  # weight bytes a warp keeps queued (sets STAGES)
BLOCK_SHARED_MAX = 110 * 1024  # at least two blocks per SM (228 KB)
# The bench flips these to A/B them on the GPU: rows per warp (16 * tiles), the folded 128
# offset (exact_q False) or a bf16 subtraction per pair, the stage count (None: by
# IN_FLIGHT_BYTES), the values of K per stage (None: `stage_values`; larger stages read longer
# runs of each row) and the warps per block.
OPTIONS = {"tiles": 1, "exact_q": False, "stages": None, "stage_values": None, "warps": WARPS}

_KERNEL = CudaKernel(
    name="kapitsa_qmv_stream",
    input_names=("x", "w", "scales", "biases", "nw", "res"),
    output_names=("y",),
    source=read_cuda_source("qmv_stream.cu"),
    header=read_cuda_source("qmv_tc.cuh") + read_cuda_source("qmv_stream.cuh"),
)


def stage_values(k: int, group_size: int, wanted: int | None = None) -> int | None:
    """Values of K per stage: `wanted` if it fits, else 256 or 128; one that divides K and holds at
    least two groups (a row's scales for one stage are a copy of 4, 8 or a multiple of 16 bytes).
    None when none fits."""
    for ks in (wanted, 256, 128) if wanted else (256, 128):
        groups = ks // group_size
        if k % ks == 0 and ks % 64 == 0 and (groups in (2, 4, 8) or (groups > 8 and groups % 8 == 0)):
            return ks
    return None


def stage_bytes(rows: int, ks: int, group_size: int, tiles: int, norm: bool) -> int:
    """Shared bytes of one stage of one warp (the layout of qmv_stream.cu)."""
    w = 16 * tiles * (ks // 2 + 16)
    x = rows * (2 * ks + 16)
    nw = 2 * ks + 16 if norm else 0
    sb = 2 * 16 * tiles * 2 * (ks // group_size)
    return (w + x + nw + sb + 15) // 16 * 16


def splits_for(n: int, k: int, ks: int, tiles: int, warps: int = WARPS) -> int:
    """Warps splitting K per tile: the fewest (a power of two up to `warps`) giving about
    TARGET_WARPS warps, each with at least three stages of its own."""
    tile_count = math.ceil(n / (16 * tiles))
    stages = k // ks
    s = 1
    while s < warps and tile_count * s < TARGET_WARPS and stages // (2 * s) >= 3:
        s *= 2
    return s


def stage_count(stage: int, ks: int, tiles: int, fixed: int | None, warps: int = WARPS) -> int:
    """Stages per warp ring: enough for IN_FLIGHT_BYTES of weights queued, within the block budget."""
    if fixed is not None and fixed < 2:
        raise ValueError(f"qmv_stream needs at least 2 stages per ring (one in flight), not {fixed}")
    weights = 16 * tiles * ks // 2
    stages = fixed or max(3, min(8, 1 + math.ceil(IN_FLIGHT_BYTES / weights)))
    while stages > 2 and warps * stages * stage > BLOCK_SHARED_MAX:
        stages -= 1
    return stages


@functools.cache  # called per mat-vec of every decode step: keep the host work to a dict lookup
def launch_config(
    rows: int,
    n: int,
    k: int,
    group_size: int,
    tiles: int,
    exact_q: bool,
    stages: int | None,
    eps: float | None = None,
    resid: bool = False,
    wanted_ks: int | None = None,
    warps: int = WARPS,
) -> tuple[tuple, int, int, int]:
    """(template arguments, grid threads, block threads, shared bytes) for one call; `eps` set:
    RMSNorm fused."""
    ks = stage_values(k, group_size, wanted_ks)
    if ks is None:
        raise ValueError(f"qmv_stream needs K ({k}) a multiple of 128 and of 2 x group size ({group_size})")
    norm = eps is not None
    stage = stage_bytes(rows, ks, group_size, tiles, norm)
    ring = stage_count(stage, ks, tiles, stages, warps)
    s = splits_for(n, k, ks, tiles, warps)
    template = (
        ("M", rows),
        ("N", n),
        ("K", k),
        ("GS", group_size),
        ("KS", ks),
        ("STAGES", ring),
        ("WARPS", warps),
        ("S", s),
        ("TILES", tiles),
        ("NORM", norm),
        ("RESID", resid),
        ("EPS_BITS", float_bits(eps or 0.0)),
        ("EXACT_Q", exact_q),
    )
    blocks = math.ceil(math.ceil(n / (16 * tiles)) * s / warps)
    reduction = warps * (tiles * 4 + (rows if norm else 0)) * 32 * 4
    shared = max(warps * ring * stage, reduction if s > 1 else 0)
    return template, blocks * warps * 32, warps * 32, shared


def supports_stream(
    x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None, *, group_size: int, bits: int
) -> bool:
    """Whether this kernel can run the call here: CUDA, 1-8 rows of bf16 x with bf16 scales,
    affine 4-bit, K a multiple of 128 and of twice the group size."""
    return (
        backend() == "cuda"
        and supported_affine(x, w, scales, biases, group_size, bits, max_rows=MAX_ROWS)
        and bits == 4
        and x.dtype == scales.dtype == biases.dtype == mx.bfloat16
        and stage_values(x.shape[-1], group_size) is not None
    )


def qmv_stream(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    *,
    group_size: int,
    norm: tuple[mx.array, float] | None = None,
    residual: mx.array | None = None,
) -> mx.array:
    """[residual +] [RMSNorm(x; norm)] @ dequantize(w)[N, K]^T -> [..., N] bf16, x [..., K] bf16 with
    M rows (residual [..., N] bf16). Callers check `supports_stream` and, for norm / residual,
    qmv_direct.supports_fused."""
    rows, k = rows_and_k(x)
    n = w.shape[0]
    eps = None if norm is None else float(norm[1])
    template, grid, block, shared = launch_config(
        rows,
        n,
        k,
        group_size,
        OPTIONS["tiles"],
        OPTIONS["exact_q"],
        OPTIONS["stages"],
        eps,
        residual is not None,
        OPTIONS["stage_values"],
        OPTIONS["warps"],
    )
    return _KERNEL(
        [x, w, scales, biases, x if norm is None else norm[0], x if residual is None else residual],
        template=template,
        grid=(grid, 1, 1),
        threadgroup=(block, 1, 1),
        output_shapes=[(*x.shape[:-1], n)],
        output_dtypes=[mx.bfloat16],
        shared_memory=shared,
    )[0]
