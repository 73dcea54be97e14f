"""The one-row mat-vec (kernels/matvec_one_row.py): compiled for sm_90 for every launched variant,
executed on the CPU from its own CUDA source by the threads emulator of test_gdn_kernel.py, and on
the H200 against the float32 reference (gpu tests)."""

from __future__ import annotations

import shutil

import mlx.core as mx
import pytest
from nvcc_check import assert_compiles, nvcc

from kapitsa.engine.kernels import backend
from kapitsa.engine.kernels import matvec_one_row as one_row
from kapitsa.engine.kernels.matvec import qmv_reference
from tests.kernels.emulation import Emulated, cuda_host_translation


def _weights(n: int, k: int, gs: int, bits: int, seed: int = 0):
    mx.random.seed(seed)
    return mx.quantize((mx.random.normal((n, k)) * 0.05).astype(mx.bfloat16), group_size=gs, bits=bits)


def _assert_compiles(template, dtype) -> None:
    """The one-row kernel rendered at `template` compiles for sm_90 with no warning."""
    assert_compiles(one_row._KERNEL.render([dtype, mx.uint32, dtype, dtype, dtype, dtype], [dtype], template))


def _rel_err(got: mx.array, ref: mx.array) -> float:
    return float(mx.abs(got.astype(mx.float32) - ref).max() / mx.abs(ref).max())


@pytest.mark.skipif(nvcc() is None, reason="needs nvcc")
@pytest.mark.parametrize(
    "dtype,rows,n,k,gs,bits",
    [
        (mx.bfloat16, 1, 34816, 5120, 64, 4),
        (mx.bfloat16, 1, 5120, 17408, 64, 4),
        (mx.float16, 1, 5120, 6144, 32, 8),
        (mx.float32, 4, 16480, 5120, 128, 4),
    ],
)
def test_cuda_source_compiles(dtype, rows, n, k, gs, bits) -> None:
    template, _, _ = one_row.launch_config(dtype, rows, n, k, gs, bits, one_row.SHAPE_BY_ROWS[rows])
    _assert_compiles(template, dtype)


@pytest.mark.skipif(nvcc() is None, reason="needs nvcc")
@pytest.mark.parametrize(
    "eps,resid,act",
    [
        (1e-6, False, None),
        (None, True, None),
        (1e-5, True, None),
        (None, True, "silu_glu"),
        (None, True, "relu2"),
    ],
)
def test_fused_variants_compile(eps, resid, act) -> None:
    dtype = mx.bfloat16
    template, _, _ = one_row.launch_config(
        dtype, 1, 17408 * 2, 5120, 64, 4, one_row.SHAPE_BY_ROWS[1], eps, resid, act
    )
    _assert_compiles(template, dtype)


@pytest.mark.skipif(shutil.which("g++") is None or nvcc() is None, reason="needs g++ and the CUDA headers")
@pytest.mark.parametrize(
    "dtype,rows,n,k,gs,bits,shape",
    [
        (mx.bfloat16, 1, 20, 640, 64, 4, (2, 2, 2)),
        (mx.float32, 3, 9, 1152, 32, 8, (2, 2, 2)),
        (mx.float16, 2, 16, 256, 128, 4, (2, 2, 2)),
        (mx.float32, 1, 9, 3072, 64, 4, (4, 2, 2, True)),  # pipelined: 3 round groups, the last short
        (mx.bfloat16, 2, 20, 1152, 32, 8, (2, 2, 2, True)),
        (mx.bfloat16, 1, 37, 640, 64, 4, (2, 2, 2, False, 3)),  # persistent: 3 blocks, 19 tasks
        (mx.float32, 2, 40, 1152, 32, 8, (4, 1, 2, True, 2)),  # persistent and pipelined
    ],
)
def test_emulated_kernel_matches_reference(
    on_cpu, monkeypatch, tmp_path, dtype, rows, n, k, gs, bits, shape
) -> None:
    """N not a multiple of the block's rows, K past one round of 32 chunks and not a multiple of
    UNROLL rounds (640 4-bit values = 20 chunks; 1152 8-bit = 72 chunks = 3 rounds; 3072 4-bit =
    96 chunks = 3 rounds); with the loop over round groups unrolled (pipelined) too, and with a
    persistent grid smaller than the tasks (each warp loops over several groups of rows)."""
    q, s, b = _weights(n, k, gs, bits)
    x = mx.random.normal((rows, k)).astype(dtype)
    ref = qmv_reference(
        x.astype(mx.float32), q, s.astype(mx.float32), b.astype(mx.float32), group_size=gs, bits=bits
    )
    monkeypatch.setattr(one_row, "_KERNEL", Emulated(one_row._KERNEL, cuda_host_translation, tmp_path))
    got = one_row.qmv_one_row(x, q, s, b, group_size=gs, bits=bits, shape=shape)
    assert got.shape == (rows, n) and got.dtype == dtype
    assert _rel_err(got, ref) < (1e-5 if dtype == mx.float32 else 8e-3)


@pytest.mark.skipif(shutil.which("g++") is None or nvcc() is None, reason="needs g++ and the CUDA headers")
@pytest.mark.parametrize(
    "dtype,rows,norm,resid",
    [(mx.bfloat16, 1, True, False), (mx.bfloat16, 1, False, True), (mx.float32, 3, True, True)],
)
def test_emulated_fused_norm_and_residual(on_cpu, monkeypatch, tmp_path, dtype, rows, norm, resid) -> None:
    """RMSNorm before the product and the residual add after it, in the kernel, against the ops."""
    n, k, gs, bits = 20, 640, 64, 4
    q, s, b = _weights(n, k, gs, bits)
    x = (mx.random.normal((rows, k)) * 3).astype(dtype)  # not unit scale: the norm matters
    nw = (1 + 0.3 * mx.random.normal((k,))).astype(dtype)
    res = mx.random.normal((rows, n)).astype(dtype)
    kw = dict(group_size=gs, bits=bits, norm=(nw, 1e-6) if norm else None, residual=res if resid else None)
    ref = one_row.qmv_one_row_reference(x, q, s, b, **kw).astype(mx.float32)
    monkeypatch.setattr(one_row, "_KERNEL", Emulated(one_row._KERNEL, cuda_host_translation, tmp_path))
    got = one_row.qmv_one_row(x, q, s, b, shape=(2, 2, 2), **kw)
    assert got.shape == (rows, n) and got.dtype == dtype
    assert _rel_err(got, ref) < (1e-5 if dtype == mx.float32 else 1e-2)
    plain = one_row.qmv_reference(x.astype(mx.float32), q, s, b, group_size=gs, bits=bits)
    assert _rel_err(plain, ref) > 0.05  # the fused parts change the result: the test can fail


@pytest.mark.skipif(shutil.which("g++") is None or nvcc() is None, reason="needs g++ and the CUDA headers")
@pytest.mark.parametrize(
    "dtype,rows,act", [(mx.bfloat16, 1, "silu_glu"), (mx.float32, 2, "silu_glu"), (mx.bfloat16, 1, "relu2")]
)
def test_emulated_activation_prologue(on_cpu, monkeypatch, tmp_path, dtype, rows, act) -> None:
    """SwiGLU (x rows = [gate | up]) or relu^2 made on load, then the product and the residual."""
    n, k, gs, bits = 20, 640, 64, 4
    q, s, b = _weights(n, k, gs, bits)
    x = (mx.random.normal((rows, 2 * k if act == "silu_glu" else k)) * 2).astype(dtype)
    res = mx.random.normal((rows, n)).astype(dtype)
    ref = one_row.qmv_one_row_reference(x, q, s, b, group_size=gs, bits=bits, residual=res, act=act)
    monkeypatch.setattr(one_row, "_KERNEL", Emulated(one_row._KERNEL, cuda_host_translation, tmp_path))
    got = one_row.qmv_one_row(x, q, s, b, group_size=gs, bits=bits, shape=(2, 2, 2), residual=res, act=act)
    assert got.shape == (rows, n) and got.dtype == dtype
    assert _rel_err(got, ref.astype(mx.float32)) < (1e-5 if dtype == mx.float32 else 1e-2)


def test_supports_only_on_cuda() -> None:
    q, s, b = _weights(32, 128, 64, 4)
    x = mx.zeros((1, 128), mx.bfloat16)
    assert one_row.supports_one_row(x, q, s, b, group_size=64, bits=4) == (backend() == "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(backend() != "cuda", reason="needs the CUDA backend")
@pytest.mark.parametrize("n,k,gs,bits", [(34816, 5120, 64, 4), (5120, 17408, 64, 4), (5120, 6144, 64, 8)])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_gpu_matches_reference(n, k, gs, bits, dtype) -> None:
    q, s, b = _weights(n, k, gs, bits)
    x = mx.random.normal((1, k)).astype(dtype)
    ref = qmv_reference(
        x.astype(mx.float32), q, s.astype(mx.float32), b.astype(mx.float32), group_size=gs, bits=bits
    )
    got = one_row.qmv_one_row(x, q, s, b, group_size=gs, bits=bits)
    assert _rel_err(got, ref) < (1e-4 if dtype == mx.float32 else 8e-3)


@pytest.mark.gpu
@pytest.mark.skipif(backend() != "cuda", reason="needs the CUDA backend")
@pytest.mark.parametrize("n,k", [(34816, 5120), (5120, 17408), (2560, 9216)])
@pytest.mark.parametrize("norm,resid", [(True, False), (False, True), (True, True)])
def test_gpu_fused_norm_and_residual(n, k, norm, resid) -> None:
    q, s, b = _weights(n, k, 64, 4)
    x = (mx.random.normal((1, k)) * 3).astype(mx.bfloat16)
    nw = (1 + 0.3 * mx.random.normal((k,))).astype(mx.bfloat16)
    res = mx.random.normal((1, n)).astype(mx.bfloat16)
    kw = dict(group_size=64, bits=4, norm=(nw, 1e-6) if norm else None, residual=res if resid else None)
    ref = one_row.qmv_one_row_reference(x, q, s, b, **kw).astype(mx.float32)
    assert _rel_err(one_row.qmv_one_row(x, q, s, b, **kw), ref) < 1e-2


def test_persistent_grid_is_capped_only_below_the_tasks() -> None:
    dtype = mx.bfloat16
    template, grid, block = one_row.launch_config(dtype, 1, 34816, 5120, 64, 4, (4, 4, 2, False, 528))
    assert ("PERSIST_BLOCKS", 528) in template and grid == 528 * block
    template, grid, block = one_row.launch_config(dtype, 1, 64, 5120, 64, 4, (4, 4, 2, False, 528))
    assert ("PERSIST_BLOCKS", 0) in template and grid == 4 * block  # fewer tasks than the cap
    assert ("PERSIST_BLOCKS", 0) in one_row.launch_config(dtype, 1, 64, 5120, 64, 4, (4, 4, 2))[0]


@pytest.mark.gpu
@pytest.mark.skipif(backend() != "cuda", reason="needs the CUDA backend")
@pytest.mark.parametrize("shape", [(4, 4, 2, False, 528), (4, 4, 2, True, 924)])
def test_gpu_persistent_matches_reference(shape) -> None:
    q, s, b = _weights(34816, 5120, 64, 4)
    x = mx.random.normal((1, 5120)).astype(mx.bfloat16)
    ref = qmv_reference(
        x.astype(mx.float32), q, s.astype(mx.float32), b.astype(mx.float32), group_size=64, bits=4
    )
    got = one_row.qmv_one_row(x, q, s, b, group_size=64, bits=4, shape=shape)
    assert _rel_err(got, ref) < 8e-3


@pytest.mark.skipif(nvcc() is None, reason="needs nvcc")
@pytest.mark.parametrize(
    "n,k,eps,resid,shape",
    [
        (16480, 5120, 1e-6, False, (4, 4, 2, True)),
        (5120, 17408, None, True, (4, 4, 2, True)),
        (34816, 5120, None, False, (4, 4, 2, False, 528)),
        (16480, 5120, 1e-6, True, (4, 4, 2, True, 924)),
    ],
)
def test_pipelined_variants_compile(n, k, eps, resid, shape) -> None:
    """The bench's pipelined and persistent launch shapes at the 27B's widths."""
    dtype = mx.bfloat16
    template, _, _ = one_row.launch_config(dtype, 1, n, k, 64, 4, shape, eps, resid, None)
    assert ("PIPELINE", shape[3]) in template
    _assert_compiles(template, dtype)


@pytest.mark.skipif(shutil.which("g++") is None or nvcc() is None, reason="needs g++ and the CUDA headers")
@pytest.mark.parametrize(
    "dtype,rows,n,norm,shape",
    [
        (mx.bfloat16, 1, 38, True, (4, 2, 2)),  # 19 columns: the last warp's second pair is past them
        (mx.float32, 2, 40, False, (2, 2, 2)),
        (mx.float32, 1, 44, True, (4, 1, 2, False, 2)),  # persistent: 2 blocks loop over 11 tasks
    ],
)
def test_emulated_glu_epilogue(on_cpu, monkeypatch, tmp_path, dtype, rows, n, norm, shape) -> None:
    """A [gate | up] projection's silu(gate) * up made in the epilogue (after the fused norm)."""
    k, gs, bits = 640, 64, 4
    q, s, b = _weights(n, k, gs, bits)
    x = (mx.random.normal((rows, k)) * 3).astype(dtype)
    nw = (1 + 0.3 * mx.random.normal((k,))).astype(dtype)
    kw = dict(group_size=gs, bits=bits, norm=(nw, 1e-6) if norm else None, glu=True)
    ref = one_row.qmv_one_row_reference(x, q, s, b, **kw).astype(mx.float32)
    monkeypatch.setattr(one_row, "_KERNEL", Emulated(one_row._KERNEL, cuda_host_translation, tmp_path))
    got = one_row.qmv_one_row(x, q, s, b, shape=shape, **kw)
    assert got.shape == (rows, n // 2) and got.dtype == dtype
    assert _rel_err(got, ref) < (1e-5 if dtype == mx.float32 else 1e-2)
    unfused = one_row.qmv_one_row_reference(x, q, s, b, **dict(kw, glu=False)).astype(mx.float32)
    assert _rel_err(unfused[:, : n // 2], ref) > 0.05  # the epilogue changes the result: the test can fail


def test_glu_refuses_what_it_cannot_make() -> None:
    q, s, b = _weights(20, 128, 64, 4)
    x = mx.zeros((1, 128), mx.bfloat16)
    with pytest.raises(ValueError, match="no residual"):
        one_row.qmv_one_row(x, q, s, b, group_size=64, bits=4, glu=True, residual=mx.zeros((1, 20)))
    with pytest.raises(ValueError, match="even number of rows per warp"):
        one_row.qmv_one_row(x, q, s, b, group_size=64, bits=4, glu=True, shape=(1, 4, 2))


@pytest.mark.skipif(nvcc() is None, reason="needs nvcc")
@pytest.mark.parametrize("n,k,eps", [(34816, 5120, 1e-6), (18432, 2560, None)])
def test_glu_variants_compile(n, k, eps) -> None:
    """The 27B's and 4B's gate/up projections with the SwiGLU epilogue (and the norm prologue)."""
    dtype = mx.bfloat16
    template, _, _ = one_row.launch_config(
        dtype, 1, n, k, 64, 4, one_row.SHAPE_BY_ROWS[1], eps, False, None, True
    )
    assert ("GLU", True) in template
    _assert_compiles(template, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(backend() != "cuda", reason="needs the CUDA backend")
@pytest.mark.parametrize("n,k", [(34816, 5120), (18432, 2560)])
def test_gpu_glu_matches_reference(n, k) -> None:
    q, s, b = _weights(n, k, 64, 4)
    x = (mx.random.normal((1, k)) * 3).astype(mx.bfloat16)
    nw = (1 + 0.3 * mx.random.normal((k,))).astype(mx.bfloat16)
    kw = dict(group_size=64, bits=4, norm=(nw, 1e-6), glu=True)
    ref = one_row.qmv_one_row_reference(x, q, s, b, **kw).astype(mx.float32)
    assert _rel_err(one_row.qmv_one_row(x, q, s, b, **kw), ref) < 1e-2


@pytest.mark.skipif(shutil.which("g++") is None or nvcc() is None, reason="needs g++ and the CUDA headers")
@pytest.mark.parametrize("rows,fused", [(2, False), (5, True), (8, True)])
def test_emulated_rows_equal_one_row_calls_bit_for_bit(on_cpu, monkeypatch, tmp_path, rows, fused) -> None:
    """A call of several rows (a verify's, KernelOptions.exact_verify) computes each row exactly as
    a one-row call (a decode step's) does, at its own launch shape, fused norm and residual too:
    what makes greedy speculation write plain decoding's tokens in bf16."""
    n, k, gs, bits = 20, 1152, 64, 4
    q, s, b = _weights(n, k, gs, bits)
    x = (mx.random.normal((rows, k)) * 3).astype(mx.bfloat16)
    nw = (1 + 0.3 * mx.random.normal((k,))).astype(mx.bfloat16)
    res = mx.random.normal((rows, n)).astype(mx.bfloat16)
    monkeypatch.setattr(one_row, "_KERNEL", Emulated(one_row._KERNEL, cuda_host_translation, tmp_path))

    def call(i: slice):
        kw = dict(norm=(nw, 1e-6), residual=res[i]) if fused else {}
        return one_row.qmv_one_row(x[i], q, s, b, group_size=gs, bits=bits, **kw)

    together = call(slice(0, rows))
    alone = mx.concatenate([call(slice(i, i + 1)) for i in range(rows)])
    assert one_row.SHAPE_BY_ROWS[rows] != one_row.SHAPE_BY_ROWS[1]  # other launch shapes, same rows
    assert mx.array_equal(together, alone).item()
