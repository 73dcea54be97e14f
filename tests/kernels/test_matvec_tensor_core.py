"""The tensor-core mat-vec (kernels/matvec_tensor_core.py): its CUDA body compiled for sm_90 for every launched
variant, and executed on the CPU by the threads emulator of test_gdn_kernel.py, with `mma.sync`
emulated from its PTX fragment layout. GPU tests compare it with MLX's own quantized mat-mul."""

from __future__ import annotations

import shutil

import mlx.core as mx
import numpy as np
import pytest
from nvcc_check import assert_compiles, nvcc

from kapitsa.engine.kernels import backend
from kapitsa.engine.kernels import matvec_tensor_core as tc
from kapitsa.engine.kernels.matvec import qmv_reference
from tests.kernels.emulation import MMA_EMULATION, Emulated, cuda_translation


def _translate(kernel, dtypes, output_dtypes, template):
    unit, function = cuda_translation(kernel, dtypes, output_dtypes, template)
    return MMA_EMULATION + unit, function


def _weights(n: int, k: int, gs: int, seed: int = 0):
    mx.random.seed(seed)
    w = mx.random.normal((n, k)) * 0.05
    q, s, b = mx.quantize(w.astype(mx.bfloat16), group_size=gs, bits=4)
    return q, s, b


LAUNCHED = [  # (rows, n, k, group size, tiles, exact_q): decode and verification shapes
    (1, 34816, 5120, 64, 2, True),
    (1, 5120, 17408, 64, 2, True),
    (8, 5120, 6144, 64, 2, True),
    (4, 16480, 5120, 128, 1, False),
    (3, 248320, 5120, 64, 1, True),
    (12, 5120, 6144, 64, 2, True),  # 9-16 rows: two 8-column blocks (longer drafts)
    (16, 34816, 5120, 64, 2, True),
    (16, 5120, 17408, 64, 2, False),
]


@pytest.mark.skipif(nvcc() is None, reason="needs nvcc")
@pytest.mark.parametrize("rows,n,k,gs,tiles,exact", LAUNCHED)
def test_cuda_source_compiles(rows, n, k, gs, tiles, exact) -> None:
    template, _, _ = tc.launch_config(rows, n, k, gs, tiles, exact)
    src = tc._KERNEL.render([mx.bfloat16, mx.uint32, mx.bfloat16, mx.bfloat16], [mx.bfloat16], template)
    assert_compiles(src)


def test_splits_fill_the_gpu_and_respect_groups() -> None:
    assert tc.splits_for(34816, 5120, 64, 2) == 2  # 1088 tiles
    assert tc.splits_for(5120, 17408, 64, 2) == 8  # 160 tiles: split K eight ways
    assert tc.splits_for(248320, 5120, 64, 2) == 1
    assert tc.splits_for(64, 64, 64, 2) == 1  # one group: nothing to split
    assert tc.splits_for(64, 128, 64, 2) == 2  # a group per split


@pytest.mark.skipif(shutil.which("g++") is None or nvcc() is None, reason="needs g++ and the CUDA headers")
@pytest.mark.parametrize(
    "rows,n,k,gs,tiles,exact",
    [
        (1, 48, 384, 64, 2, True),
        (3, 40, 384, 128, 1, False),
        (8, 32, 256, 64, 2, False),
        (5, 24, 640, 64, 1, True),
        (12, 40, 384, 64, 2, True),  # two blocks of x rows, K split four ways
        (16, 32, 512, 128, 1, False),
        (9, 24, 640, 64, 1, True),
    ],
)
def test_emulated_kernel_matches_reference(monkeypatch, tmp_path, rows, n, k, gs, tiles, exact) -> None:
    q, s, b = _weights(n, k, gs)
    x = (mx.random.normal((rows, k)) * 2).astype(mx.bfloat16)
    ref = qmv_reference(
        x.astype(mx.float32), q, s.astype(mx.float32), b.astype(mx.float32), group_size=gs, bits=4
    )
    monkeypatch.setattr(tc, "_KERNEL", Emulated(tc._KERNEL, _translate, tmp_path))
    got = tc.qmv_tensor_core(x, q, s, b, group_size=gs, tiles=tiles, exact_q=exact).astype(mx.float32)
    assert got.shape == (rows, n)
    err = float(mx.abs(got - ref).max() / mx.abs(ref).max())
    assert err < 8e-3, err  # the output is bf16: one rounding of ~0.4% at most per value


def test_supports() -> None:
    q, s, b = _weights(32, 128, 64)
    x = mx.zeros((1, 128), mx.bfloat16)
    assert tc.supports_tensor_core(x, q, s, b, group_size=64, bits=4) == (backend() == "cuda")
    x16, x17 = mx.zeros((16, 128), mx.bfloat16), mx.zeros((17, 128), mx.bfloat16)
    assert tc.supports_tensor_core(x16, q, s, b, group_size=64, bits=4) == (backend() == "cuda")
    assert not tc.supports_tensor_core(x17, q, s, b, group_size=64, bits=4)


@pytest.mark.gpu
@pytest.mark.skipif(backend() != "cuda", reason="needs the CUDA backend")
@pytest.mark.parametrize("rows", [1, 2, 4, 8, 12, 16])
@pytest.mark.parametrize(
    "n,k,gs", [(34816, 5120, 64), (5120, 17408, 64), (16480, 5120, 128), (5120, 6144, 64)]
)
@pytest.mark.parametrize("exact", [True, False])
def test_gpu_matches_stock(rows, n, k, gs, exact) -> None:
    q, s, b = _weights(n, k, gs)
    x = mx.random.normal((rows, k)).astype(mx.bfloat16)
    ref = qmv_reference(
        x.astype(mx.float32), q, s.astype(mx.float32), b.astype(mx.float32), group_size=gs, bits=4
    )
    got = tc.qmv_tensor_core(x, q, s, b, group_size=gs, exact_q=exact).astype(mx.float32)
    err = float(mx.abs(got - ref).max() / mx.abs(ref).max())
    assert err < 8e-3, err
    assert np.isfinite(np.array(got)).all()


def test_row_counts_share_a_compile_per_block_of_eight() -> None:
    # a new decode batch size must not compile new kernels (NVRTC: ~1 s each on the H200)
    templates = {rows: tc.launch_config(rows, 5120, 6144, 64, 2, True)[0] for rows in range(1, 17)}
    assert len({templates[r] for r in range(1, 9)}) == 1
    assert len({templates[r] for r in range(9, 17)}) == 1
    assert templates[8] != templates[9]


@pytest.mark.skipif(shutil.which("g++") is None or nvcc() is None, reason="needs g++ and the CUDA headers")
def test_emulated_kernel_reads_rows_from_a_batch_shape(monkeypatch, tmp_path) -> None:
    # decode passes x as [B, T, K]: the rows are every leading dimension's product
    n, k, gs = 24, 384, 64
    q, s, b = _weights(n, k, gs)
    x = (mx.random.normal((2, 3, k)) * 2).astype(mx.bfloat16)
    ref = qmv_reference(
        x.reshape(6, k).astype(mx.float32),
        q,
        s.astype(mx.float32),
        b.astype(mx.float32),
        group_size=gs,
        bits=4,
    )
    monkeypatch.setattr(tc, "_KERNEL", Emulated(tc._KERNEL, _translate, tmp_path))
    got = tc.qmv_tensor_core(x, q, s, b, group_size=gs).astype(mx.float32)
    assert got.shape == (2, 3, n)
    err = float(mx.abs(got.reshape(6, n) - ref).max() / mx.abs(ref).max())
    assert err < 8e-3, err
