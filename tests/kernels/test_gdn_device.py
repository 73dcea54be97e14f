"""The fused Gated DeltaNet kernels on a device (`gpu`: CUDA, `metal`) against the reference, and
the decode variant (`gdn_decode`: conv state and new rows read in place), emulated on the CPU and
on the GPU."""

from __future__ import annotations

import shutil

import mlx.core as mx
import pytest
from nvcc_check import assert_compiles, nvcc

from kapitsa.engine.kernels import backend, gdn, gdn_plan, gdn_reference
from kapitsa.engine.ops.conv import causal_conv_reference
from tests.kernels.emulation import Emulated, cuda_translation
from tests.kernels.test_gdn_emulated import BrokenKernel
from tests.kernels.test_gdn_kernel import embed_in_projection
from tests.kernels.test_gdn_reference import SHAPES, assert_close, make_inputs, rel_err

# ----------------------------------------------------------------- kernels on a device


def _device_cases():
    for shape in SHAPES:
        for B in (1, 3):
            for T in (1, 2, 8):
                for dtype in (mx.bfloat16, mx.float32):
                    for masked in (False, True):
                        yield shape, B, T, dtype, masked


def use_exact_conv(monkeypatch, dtype) -> None:
    """float32 comparisons on a GPU: MLX may run float32 convolutions (mx.conv1d, the model's path
    for T > 1) as TF32 (MLX_ENABLE_TF32 defaults to 1), ~1e-3 off; the reference then takes the
    plain multiply-add conv, the math the kernel does in float32."""
    if dtype == mx.float32:
        monkeypatch.setattr(gdn_reference, "causal_conv", causal_conv_reference)


def _compare_on_device(shape: str, B: int, T: int, dtype, masked: bool, monkeypatch) -> None:
    use_exact_conv(monkeypatch, dtype)
    hk, hv, dk, dv = SHAPES[shape]
    mask = None
    if masked:  # any pattern: right padding, replayed prefixes, a fully masked row
        mx.random.seed(T)
        mask = mx.random.bernoulli(0.6, (B, T))
    args, heads = make_inputs(B, T, hk, hv, dk, dv, dtype=dtype, mask=mask, seed=B * 100 + T)
    dims = {k: heads[k] for k in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")}
    assert gdn_plan.supports(args["conv_in"], args["conv_weight"], args["state"], **dims)
    assert gdn.kernel_works(backend()), "the kernel failed its probe (see the warning logged)"
    out, state = gdn.gdn_step(**args, **heads)
    ref_out, ref_state = gdn_reference.gdn_step_reference(**args, **heads)
    assert out.dtype == ref_out.dtype and out.shape == ref_out.shape and state.shape == ref_state.shape
    assert_close(out, ref_out, dtype)
    assert_close(state, ref_state, dtype)
    if masked:
        assert mx.array_equal(mx.where(mask[..., None], 0, out), mx.zeros_like(out)).item()


@pytest.mark.gpu
@pytest.mark.parametrize("shape,B,T,dtype,masked", list(_device_cases()))
def test_cuda_gdn_step_matches_reference(shape, B, T, dtype, masked, monkeypatch) -> None:
    if backend() != "cuda":
        pytest.skip("needs the CUDA backend")
    _compare_on_device(shape, B, T, dtype, masked, monkeypatch)


@pytest.mark.gpu
def test_cuda_gdn_step_without_state_and_long_chunks(monkeypatch) -> None:
    """No incoming state (first step); 64 tokens (several shared-memory chunks) with other head
    dims at the register limit."""
    if backend() != "cuda":
        pytest.skip("needs the CUDA backend")
    use_exact_conv(monkeypatch, mx.float32)
    cases = (
        (2, 3, 16, 48, 128, 128, False),
        (1, 64, 2, 4, 64, 256, True),
        (2, 5, 1, 3, 256, 64, True),
        (2, 40, 1, 2, 32, 32, True),  # one warp per block, more tokens than threads
    )
    for B, T, hk, hv, dk, dv, state in cases:
        args, heads = make_inputs(B, T, hk, hv, dk, dv, state=state, seed=T)
        dims = {k: heads[k] for k in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")}
        assert gdn_plan.supports(args["conv_in"], args["conv_weight"], args["state"], **dims)
        assert gdn.kernel_works("cuda"), "the kernel failed its probe (see the warning logged)"
        out, new_state = gdn.gdn_step(**args, **heads)
        ref_out, ref_state = gdn_reference.gdn_step_reference(**args, **heads)
        assert rel_err(out, ref_out) < 1e-4 and rel_err(new_state, ref_state) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_cuda_gdn_step_reads_projection_views(packed: bool, dtype) -> None:
    """z, b, a read in place from a fused in-projection give the same result as plain arrays."""
    if backend() != "cuda":
        pytest.skip("needs the CUDA backend")
    hk, hv, dk, dv = SHAPES["4b"]
    args, heads = make_inputs(3, 4, hk, hv, dk, dv, dtype=dtype, seed=11)
    views = embed_in_projection(args, packed=packed, hk=hk, hv=hv, dk=dk, dv=dv)
    views = {
        k: gdn_reference.HeadView(v.array.astype(dtype), v.offset, v.group, v.group_stride)
        for k, v in views.items()
    }
    assert gdn.kernel_works("cuda"), "the kernel failed its probe (see the warning logged)"
    plain = gdn.gdn_step(**args, **heads)
    viewed = gdn.gdn_step(**dict(args, **views), **heads)
    assert mx.array_equal(plain[0], viewed[0]).item() and mx.array_equal(plain[1], viewed[1]).item()


@pytest.mark.metal
@pytest.mark.parametrize("shape,B,T,dtype,masked", list(_device_cases()))
def test_metal_gdn_step_matches_reference(shape, B, T, dtype, masked, monkeypatch) -> None:
    if backend() != "metal":
        pytest.skip("needs the Metal backend")
    _compare_on_device(shape, B, T, dtype, masked, monkeypatch)


# ------------------------------------------------------------- the decode variant (gdn_decode)


def _decode_inputs(B, T, hk, hv, dk, dv, dtype, extra_columns, seed=7):
    """gdn_step's inputs split as a decode step has them: the conv state, and the new rows as the
    first C columns of a wider projection output (x_new), plus the concatenated conv_in."""
    args, heads = make_inputs(B, T, hk, hv, dk, dv, dtype=dtype, seed=seed)
    heads.pop("mask")
    conv_in = args.pop("conv_in")
    K = args["conv_weight"].shape[1]
    conv_state, rows = conv_in[:, : K - 1], conv_in[:, K - 1 :]
    x_new = mx.concatenate([rows, mx.random.normal((B, T, extra_columns)).astype(dtype)], axis=-1)
    return conv_state, x_new, conv_in, args, heads


@pytest.mark.skipif(shutil.which("g++") is None or nvcc() is None, reason="needs g++ and the CUDA headers")
@pytest.mark.parametrize(
    "B,T,hk,hv,dk,dv,dtype,extra",
    [
        (1, 1, 1, 2, 32, 32, mx.float32, 24),  # decode: one token, a wider projection
        (2, 3, 2, 4, 32, 64, mx.bfloat16, 0),  # short chain, two key heads shared by value heads
    ],
)
def test_decode_variant_emulated_matches_the_concatenating_path(
    B, T, hk, hv, dk, dv, dtype, extra, monkeypatch, tmp_path
) -> None:
    """gdn_decode's CUDA launch (the real body, host threads): the same out and state as gdn_step
    on the concatenated window, and the window's last K-1 rows as the next conv state, exactly."""
    conv_state, x_new, conv_in, args, heads = _decode_inputs(B, T, hk, hv, dk, dv, dtype, extra)
    ref_out, ref_state = gdn_reference.gdn_step_reference(conv_in, **args, **heads)
    monkeypatch.setattr(gdn, "backend", lambda: "cuda")
    monkeypatch.setattr(gdn, "decode_kernel_works", lambda kind: True)
    monkeypatch.setattr(
        gdn, "CUDA_DECODE_KERNEL", Emulated(gdn.CUDA_DECODE_KERNEL, cuda_translation, tmp_path)
    )
    out, conv_out, new_state = gdn.gdn_decode(conv_state, x_new, *args.values(), **heads)
    assert len(list(tmp_path.iterdir())) == 1  # the kernel ran, not the fallback
    assert_close(out, ref_out, dtype, fp32_tol=1e-5)
    assert_close(new_state, ref_state, dtype, fp32_tol=1e-5)
    assert conv_out.dtype == conv_state.dtype and mx.array_equal(conv_out, conv_in[:, T:]).item()


def test_decode_variant_falls_back_to_concatenating_off_cuda() -> None:
    conv_state, x_new, conv_in, args, heads = _decode_inputs(1, 1, 1, 2, 32, 32, mx.float32, 8)
    out, conv_out, new_state = gdn.gdn_decode(conv_state, x_new, *args.values(), **heads)
    ref_out, ref_state = gdn.gdn_step(conv_in, **args, **heads)
    assert mx.array_equal(out, ref_out).item() and mx.array_equal(new_state, ref_state).item()
    assert mx.array_equal(conv_out, conv_in[:, 1:]).item()


@pytest.mark.skipif(nvcc() is None, reason="needs nvcc")
def test_decode_variant_compiles() -> None:
    conv_state, x_new, _, args, heads = _decode_inputs(1, 1, 16, 48, 128, 128, mx.bfloat16, 96, seed=1)
    window = gdn._Window((1, 4, conv_state.shape[2]), mx.bfloat16)
    plan = gdn_plan.plan_for("cuda", (window, *args.values(), None), (16, 48, 128, 128), 1e-6)
    template = (*plan.template, ("X_ROW", x_new.shape[-1]), ("CT", mx.bfloat16))
    dtypes = [x.dtype for x in (conv_state, x_new, *args.values())] + [mx.bool_]
    src = gdn.CUDA_DECODE_KERNEL.render(dtypes, [mx.bfloat16, mx.float32, mx.bfloat16], template)
    assert_compiles(src)


@pytest.mark.gpu
@pytest.mark.skipif(backend() != "cuda", reason="needs the CUDA backend")
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_gpu_decode_variant_matches_the_concatenating_path(shape, dtype, monkeypatch) -> None:
    use_exact_conv(monkeypatch, dtype)
    hk, hv, dk, dv = SHAPES[shape]
    assert gdn.decode_kernel_works("cuda"), "the decode variant failed its probe (see the warning logged)"
    conv_state, x_new, conv_in, args, heads = _decode_inputs(1, 1, hk, hv, dk, dv, dtype, 100)
    out, conv_out, new_state = gdn.gdn_decode(conv_state, x_new, *args.values(), **heads)
    ref_out, ref_state = gdn.gdn_step(conv_in, **args, **heads)
    assert_close(out, ref_out, dtype, fp32_tol=1e-5)
    assert_close(new_state, ref_state, dtype, fp32_tol=1e-5)
    assert mx.array_equal(conv_out, conv_in[:, 1:]).item()


@pytest.mark.skipif(shutil.which("g++") is None or nvcc() is None, reason="needs g++ and the CUDA headers")
def test_decode_variant_probe_passes_with_the_real_body_and_fails_a_broken_one(monkeypatch, tmp_path) -> None:
    """decode_kernel_works on CUDA: the emulated real body agrees with the concatenating path
    (out, next conv state, state); a kernel that raises or returns wrong numbers is not used."""
    monkeypatch.setattr(gdn, "backend", lambda: "cuda")
    monkeypatch.setattr(gdn, "kernel_works", lambda kind: True)
    monkeypatch.setattr(
        gdn, "CUDA_DECODE_KERNEL", Emulated(gdn.CUDA_DECODE_KERNEL, cuda_translation, tmp_path)
    )
    gdn.decode_kernel_works.cache_clear()
    try:
        assert gdn.decode_kernel_works("cuda")
        for result in (None, 0.5):
            gdn.decode_kernel_works.cache_clear()
            monkeypatch.setattr(gdn, "CUDA_DECODE_KERNEL", BrokenKernel(result))
            assert not gdn.decode_kernel_works("cuda")
    finally:
        gdn.decode_kernel_works.cache_clear()
