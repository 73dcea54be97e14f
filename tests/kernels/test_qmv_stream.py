"""The streaming tensor-core mat-vec (kernels/qmv_stream.py): its CUDA body compiled for sm_90 for
the launched variants, and executed on the CPU by the threads emulator (test_gdn_kernel.py) with
mma.sync (test_qmv_tc.py), cp.async (plain copies) and ldmatrix (a warp exchange) emulated. GPU
tests compare it with MLX's own quantized mat-mul and with the fused norm / residual reference."""

from __future__ import annotations

import shutil

import mlx.core as mx
import numpy as np
import pytest
from nvcc_check import assert_compiles, nvcc

from kapitsa.engine.kernels import backend
from kapitsa.engine.kernels import qmv_stream as stream
from kapitsa.engine.kernels.qmv_direct import qmv_direct_reference
from tests.kernels.test_gdn_kernel import Emulated, cuda_translation
from tests.kernels.test_qmv_tc import MMA_EMULATION

# ldmatrix.x4 as the PTX ISA defines it: lane l supplies the address of row l % 8 of matrix l / 8
# and receives, from each matrix j, the 32-bit word l % 4 of row l / 4.
STREAM_EMULATION = r"""
alignas(128) static unsigned char emu_smem_buf[256 * 1024];
unsigned char* kapitsa_emu_smem() { return emu_smem_buf; }
static const void* emu_rows[32][32];
void kapitsa_emu_ldmatrix4(uint32_t* r, const void* row) {
  const int w = threadIdx.x / 32, l = threadIdx.x % 32;
  emu_rows[w][l] = row;
  __syncwarp();
  for (int j = 0; j < 4; ++j) std::memcpy(&r[j], (const char*)emu_rows[w][8 * j + l / 4] + 4 * (l % 4), 4);
  __syncwarp();
}
"""


def _translate(kernel, dtypes, output_dtypes, template):
    unit, function = cuda_translation(kernel, dtypes, output_dtypes, template)
    return MMA_EMULATION + STREAM_EMULATION + unit, function


def _weights(n: int, k: int, gs: int, seed: int = 0):
    mx.random.seed(seed)
    w = mx.random.normal((n, k)) * 0.05
    return mx.quantize(w.astype(mx.bfloat16), group_size=gs, bits=4)


def _inputs(rows: int, n: int, k: int, gs: int, fused: bool, seed: int = 0):
    q, s, b = _weights(n, k, gs, seed)
    x = (mx.random.normal((rows, k)) * 2).astype(mx.bfloat16)
    extra = {}
    if fused:
        nw = (1 + 0.3 * mx.random.normal((k,))).astype(mx.bfloat16)
        res = mx.random.normal((rows, n)).astype(mx.bfloat16)
        extra = dict(norm=(nw, 1e-6), residual=res)
    return x, q, s, b, extra


def _rel_err(got: mx.array, ref: mx.array) -> float:
    got, ref = got.astype(mx.float32), ref.astype(mx.float32)
    return float(mx.abs(got - ref).max() / mx.abs(ref).max())


LAUNCHED = [  # (rows, n, k, group size, tiles, exact_q, fused): decode and verification shapes
    (1, 34816, 5120, 64, 1, False, False),  # 27B gate/up
    (1, 5120, 17408, 64, 1, False, True),  # 27B down (K split), residual fused
    (1, 16480, 5120, 64, 1, True, True),  # 27B GDN in-projection, norm fused
    (1, 5120, 6144, 64, 2, False, False),
    (1, 4096, 2688, 64, 1, False, True),  # Nemotron's K: 128 per stage
    (1, 248320, 5120, 64, 1, False, False),  # vocabulary head
    (4, 5120, 6144, 128, 1, False, False),
    (8, 5120, 17408, 32, 2, True, True),
]
LONG_STAGES = [(1, 34816, 5120, 64, 1024, 2), (1, 5120, 17408, 64, 1024, 2), (1, 5120, 6144, 128, 512, 4)]


@pytest.mark.skipif(nvcc() is None, reason="needs nvcc")
@pytest.mark.parametrize("rows,n,k,gs,tiles,exact,fused", LAUNCHED)
def test_cuda_source_compiles(rows, n, k, gs, tiles, exact, fused) -> None:
    eps = 1e-6 if fused else None
    template, _, _, shared = stream.launch_config(rows, n, k, gs, tiles, exact, None, eps, fused)
    assert shared <= 227 * 1024
    dtypes = [mx.bfloat16, mx.uint32] + [mx.bfloat16] * 4
    assert_compiles(stream._KERNEL.render(dtypes, [mx.bfloat16], template))


@pytest.mark.skipif(nvcc() is None, reason="needs nvcc")
@pytest.mark.parametrize("rows,n,k,gs,ks,warps", LONG_STAGES)
def test_long_stages_compile(rows, n, k, gs, ks, warps) -> None:
    """Stages of 512-1024 values (rows read in 256-512 byte runs), scales copied in 16-byte pieces."""
    template, _, block, shared = stream.launch_config(rows, n, k, gs, 1, False, 3, None, False, ks, warps)
    assert dict(template)["KS"] == ks and block == 32 * warps and shared <= 227 * 1024
    dtypes = [mx.bfloat16, mx.uint32] + [mx.bfloat16] * 4
    assert_compiles(stream._KERNEL.render(dtypes, [mx.bfloat16], template))


def test_launch_config_fills_the_gpu_and_keeps_stages_queued() -> None:
    assert stream.stage_values(5120, 64) == 256
    assert stream.stage_values(2688, 64) == 128  # 2688 = 21 x 128
    assert stream.stage_values(2688, 128) is None  # a 128-value stage would hold one group
    assert stream.stage_values(5120 + 64, 64) is None
    assert stream.stage_values(5120, 64, 1024) == 1024  # 16 groups: scales copied in 16-byte pieces
    assert stream.stage_values(5120, 64, 2048) == 256  # 2048 does not divide 5120: the default
    assert stream.stage_values(5120, 64, 320) == 256  # 5 groups a stage: no copy size fits
    assert stream.splits_for(34816, 5120, 256, 1) == 1  # 2176 tiles already fill the GPU
    assert stream.splits_for(5120, 17408, 256, 1) == 4  # 320 tiles: split K
    assert stream.splits_for(64, 256, 256, 1) == 1  # one stage: nothing to split
    template, grid, block, shared = stream.launch_config(1, 5120, 17408, 64, 1, False, None)
    t = dict(template)
    weights_queued = (t["STAGES"] - 1) * 16 * t["KS"] // 2
    assert weights_queued >= stream.IN_FLIGHT_BYTES - 16 * t["KS"] // 2
    assert shared <= stream.BLOCK_SHARED_MAX and block == stream.WARPS * 32
    assert grid == 320 * 4 * 32  # every (tile, split) has a warp
    with pytest.raises(ValueError, match="multiple of 128"):
        stream.launch_config(1, 64, 192, 64, 1, False, None)
    with pytest.raises(ValueError, match="at least 2 stages"):
        stream.launch_config(1, 64, 256, 64, 1, False, 1)


@pytest.mark.skipif(shutil.which("g++") is None or nvcc() is None, reason="needs g++ and the CUDA headers")
@pytest.mark.parametrize(
    "rows,n,k,gs,tiles,exact,stages,fused,ks,warps",
    [
        (1, 40, 512, 64, 1, False, None, False, None, 4),  # a partial tile, two stages
        (1, 24, 1536, 64, 1, True, 3, True, None, 4),  # K split, ring wrapping, norm + residual
        (3, 48, 768, 128, 2, False, 2, True, None, 4),  # two tiles per warp, several x rows
        (8, 16, 384, 32, 1, False, 4, False, None, 4),  # 128 per stage, eight x rows
        (5, 32, 2048, 64, 1, True, 3, True, None, 4),  # K split with the norm's partial sums
        (2, 40, 4096, 64, 1, False, 3, True, 1024, 2),  # long stages: scales in 16-byte pieces
    ],
)
def test_emulated_kernel_matches_reference(
    monkeypatch, tmp_path, rows, n, k, gs, tiles, exact, stages, fused, ks, warps
) -> None:
    x, q, s, b, extra = _inputs(rows, n, k, gs, fused)
    ref = qmv_direct_reference(x, q, s, b, group_size=gs, bits=4, **extra)
    monkeypatch.setattr(stream, "_KERNEL", Emulated(stream._KERNEL, _translate, tmp_path))
    monkeypatch.setitem(stream.OPTIONS, "tiles", tiles)
    monkeypatch.setitem(stream.OPTIONS, "exact_q", exact)
    monkeypatch.setitem(stream.OPTIONS, "stages", stages)
    monkeypatch.setitem(stream.OPTIONS, "stage_values", ks)
    monkeypatch.setitem(stream.OPTIONS, "warps", warps)
    monkeypatch.setattr(stream, "TARGET_WARPS", 10_000)  # small shapes still split K
    stream.launch_config.cache_clear()
    try:
        got = stream.qmv_stream(x, q, s, b, group_size=gs, **extra)
    finally:
        stream.launch_config.cache_clear()
    assert got.shape == (rows, n) and got.dtype == mx.bfloat16
    assert _rel_err(got, ref) < 8e-3  # the output is bf16: one rounding of ~0.4% per value


def test_supports() -> None:
    q, s, b = _weights(32, 256, 64)
    on_cuda = backend() == "cuda"
    assert stream.supports_stream(mx.zeros((1, 256), mx.bfloat16), q, s, b, group_size=64, bits=4) == on_cuda
    assert stream.supports_stream(mx.zeros((8, 256), mx.bfloat16), q, s, b, group_size=64, bits=4) == on_cuda
    assert not stream.supports_stream(mx.zeros((9, 256), mx.bfloat16), q, s, b, group_size=64, bits=4)
    assert not stream.supports_stream(mx.zeros((1, 256), mx.float16), q, s, b, group_size=64, bits=4)
    q8, s8, b8 = mx.quantize(mx.zeros((32, 256), mx.bfloat16), group_size=64, bits=8)
    assert not stream.supports_stream(mx.zeros((1, 256), mx.bfloat16), q8, s8, b8, group_size=64, bits=8)


@pytest.mark.gpu
@pytest.mark.skipif(backend() != "cuda", reason="needs the CUDA backend")
@pytest.mark.parametrize("rows", [1, 4, 8])
@pytest.mark.parametrize(
    "n,k,gs", [(34816, 5120, 64), (5120, 17408, 64), (16480, 5120, 128), (4096, 2688, 64), (5120, 6144, 32)]
)
@pytest.mark.parametrize("fused", [False, True])
def test_gpu_matches_reference(rows, n, k, gs, fused) -> None:
    x, q, s, b, extra = _inputs(rows, n, k, gs, fused)
    ref = qmv_direct_reference(x, q, s, b, group_size=gs, bits=4, **extra)
    got = stream.qmv_stream(x, q, s, b, group_size=gs, **extra)
    assert _rel_err(got, ref) < 8e-3
    assert np.isfinite(np.array(got.astype(mx.float32))).all()
