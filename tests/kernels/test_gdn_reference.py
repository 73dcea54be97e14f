"""The Gated DeltaNet step's reference (kernels/gdn_reference.py) against the model's layer (both
Qwen3.5 and Qwen3-Next layouts, ragged batches), its masking, and the shape checks that both the
reference and the kernel path raise."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from kapitsa.engine.cache.layers import RecurrentCache, StepInfo
from kapitsa.engine.kernels import backend, gdn, gdn_reference
from kapitsa.engine.models.qwen3_5 import GatedDeltaNet, ModelArgs

SHAPES = {"27b": (16, 48, 128, 128), "4b": (16, 32, 128, 128)}  # Hk, Hv, Dk, Dv


def make_inputs(B, T, hk, hv, dk, dv, *, dtype=mx.float32, K=4, seed=0, mask=None, state=True):
    """Random inputs with realistic magnitudes: decays in (0, 1), unit-norm-ish q/k, O(1) values."""
    mx.random.seed(seed)
    C = 2 * hk * dk + hv * dv
    args = dict(
        conv_in=mx.random.normal((B, K - 1 + T, C)).astype(dtype),
        conv_weight=(0.5 * mx.random.normal((C, K, 1))).astype(dtype),
        a=mx.random.normal((B, T, hv)).astype(dtype),
        b=mx.random.normal((B, T, hv)).astype(dtype),
        A_log=mx.log(mx.random.uniform(1.0, 16.0, (hv,))),
        dt_bias=mx.random.normal((hv,)).astype(dtype),
        z=mx.random.normal((B, T, hv, dv)).astype(dtype),
        norm_weight=(1.0 + 0.1 * mx.random.normal((dv,))).astype(dtype),
        state=0.1 * mx.random.normal((B, hv, dv, dk)) if state else None,
    )
    heads = dict(num_k_heads=hk, num_v_heads=hv, head_k_dim=dk, head_v_dim=dv, norm_eps=1e-6, mask=mask)
    return args, heads


def assert_close(got: mx.array, ref: mx.array, dtype, *, fp32_tol: float = 1e-4) -> None:
    """float32: max error within fp32_tol of the largest value. bf16/fp16: the op path rounds
    q/k/v/y/norm in the activation dtype and the kernel accumulates the conv and dots in float32,
    so single values may differ by a few ulps (about 1-2% of the largest output, as much as
    either differs from a float32 evaluation) while the mean error stays small."""
    assert got.shape == ref.shape and got.dtype == ref.dtype, (got.shape, ref.shape, got.dtype, ref.dtype)
    worst = rel_err(got, ref)
    if dtype == mx.float32:
        assert worst < fp32_tol, worst
        return
    diff = mx.abs(got.astype(mx.float32) - ref.astype(mx.float32))
    mean = float(diff.mean()) / max(float(mx.abs(ref.astype(mx.float32)).mean()), 1e-6)
    assert worst < 4e-2 and mean < 1e-2, (worst, mean)


def rel_err(got: mx.array, ref: mx.array) -> float:
    got, ref = got.astype(mx.float32), ref.astype(mx.float32)
    return float(mx.abs(got - ref).max()) / max(float(mx.abs(ref).max()), 1e-6)


# ---------------------------------------------------------------- reference == the model's layer


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("lengths", [[1, 1], [3, 3], [3, 1]])
@pytest.mark.parametrize("fused", [False, True])
def test_reference_matches_model_layer(model_type: str, lengths: list[int], fused: bool) -> None:
    """`gdn_step_reference` on the layer's own conv_in/z/a/b gives its output and next state;
    with the layer's fused in-projection, z/b/a given as `projection_views` of it do too."""
    mx.random.seed(3)
    args = ModelArgs(
        model_type=model_type,
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
    )
    layer = GatedDeltaNet(args)
    layer.conv1d.weight = 0.5 * mx.random.normal(layer.conv1d.weight.shape)
    layer.A_log = mx.log(mx.random.uniform(1.0, 16.0, (4,)))
    layer.dt_bias = mx.random.normal((4,))
    layer.norm.weight = 1.0 + 0.1 * mx.random.normal((32,))
    layer.out_proj = nn.Identity()  # the layer then returns the gated norm's output
    if fused:
        assert layer.fuse()
    B, T = len(lengths), max(lengths)
    conv = mx.random.normal((B, 3, layer.conv_dim))
    state = 0.1 * mx.random.normal((B, 4, 32, 32))
    cache = RecurrentCache((3, layer.conv_dim), (4, 32, 32), conv=conv, state=state)
    x = mx.random.normal((B, T, 64))
    info = StepInfo(T, lengths, [5] * B)
    got_layer = layer(x, info, cache)

    qkv, z, b, a = layer._project(x)
    if fused:
        dims = dict(num_k_heads=2, num_v_heads=4, head_k_dim=32, head_v_dim=32)
        z, b, a = gdn_reference.projection_views(layer.in_proj(x), packed=layer.packed, **dims)
    out, new_state = gdn_reference.gdn_step_reference(
        mx.concatenate([conv, qkv], axis=1),
        layer.conv1d.weight,
        a,
        b,
        layer.A_log,
        layer.dt_bias,
        z,
        layer.norm.weight,
        state,
        num_k_heads=2,
        num_v_heads=4,
        head_k_dim=32,
        head_v_dim=32,
        norm_eps=args.rms_norm_eps,
        mask=info.recurrent_mask,
    )
    assert mx.allclose(out, got_layer, rtol=1e-5, atol=1e-6).item()
    assert mx.allclose(new_state, cache.state, rtol=1e-5, atol=1e-6).item()


def test_masked_steps_keep_state_and_output_zero() -> None:
    args, heads = make_inputs(2, 3, 1, 2, 32, 32, mask=mx.array([[True, False, True], [False, False, False]]))
    out, state = gdn_reference.gdn_step_reference(**args, **heads)
    assert mx.array_equal(out[0, 1], mx.zeros_like(out[0, 1])).item()
    assert mx.array_equal(out[1], mx.zeros_like(out[1])).item()
    assert mx.array_equal(state[1], args["state"][1]).item()  # a fully masked row keeps its state
    # Row 0 equals running its real tokens 0 and 2 alone, one at a time (each with its conv window).
    row0 = dict(args, state=args["state"][:1])
    first, s1 = gdn_reference.gdn_step_reference(**_one_token(row0, args, 0), **dict(heads, mask=None))
    second, s2 = gdn_reference.gdn_step_reference(
        **_one_token(dict(row0, state=s1), args, 2), **dict(heads, mask=None)
    )
    assert mx.allclose(out[0, 0], first[0, 0], atol=1e-6).item()
    assert mx.allclose(out[0, 2], second[0, 0], atol=1e-6).item()
    assert mx.allclose(state[0], s2[0], atol=1e-6).item()


def _one_token(base: dict, full: dict, t: int) -> dict:
    """Row 0's token t as a T=1 call (its conv window is rows t..t+K-1 of conv_in)."""
    K = full["conv_weight"].shape[1]
    return dict(
        base,
        conv_in=full["conv_in"][:1, t : t + K],
        a=full["a"][:1, t : t + 1],
        b=full["b"][:1, t : t + 1],
        z=full["z"][:1, t : t + 1],
    )


@pytest.mark.parametrize(
    "field,bad,message",
    [
        ("conv_in", (1, 6, 192), "conv_in must be"),
        ("state", (1, 2, 32, 64), "state must be"),
        ("a", (1, 2, 3), "a must be"),
        ("z", (1, 2, 2, 16), "z must be"),
        ("norm_weight", (64,), "norm_weight must be"),
        ("conv_weight", (100, 4, 1), "conv_weight must be"),
    ],
)
def test_wrong_shapes_raise_a_clear_error(field: str, bad: tuple, message: str) -> None:
    args, heads = make_inputs(1, 2, 1, 2, 32, 32)
    args[field] = mx.zeros(bad)
    with pytest.raises(gdn_reference.GdnShapeError, match=message):
        gdn.gdn_step(**args, **heads)


def test_view_past_the_projection_raises() -> None:
    args, heads = make_inputs(1, 2, 1, 2, 32, 32)
    proj = mx.zeros((1, 2, 70))
    with pytest.raises(gdn_reference.GdnShapeError, match="z view"):
        gdn.gdn_step(**dict(args, z=gdn_reference.HeadView(proj, 8, 2)), **heads)  # needs columns 8..71
    with pytest.raises(gdn_reference.GdnShapeError, match="b.array must be"):
        gdn.gdn_step(**dict(args, b=gdn_reference.HeadView(mx.zeros((1, 3, 70)), 0, 2)), **heads)


def test_bad_mask_and_head_layout_raise() -> None:
    args, heads = make_inputs(1, 2, 1, 2, 32, 32)
    with pytest.raises(gdn_reference.GdnShapeError, match="mask must be"):
        gdn.gdn_step(**args, **dict(heads, mask=mx.ones((1, 3), mx.bool_)))
    with pytest.raises(gdn_reference.GdnShapeError, match="head layout"):
        gdn.gdn_step(**args, **dict(heads, num_k_heads=3, num_v_heads=2))


def test_gdn_step_equals_reference_off_gpu() -> None:
    args, heads = make_inputs(2, 3, 1, 2, 32, 32, mask=mx.array([[True, True, False], [True, True, True]]))
    if backend() is None:
        for got, ref in zip(
            gdn.gdn_step(**args, **heads), gdn_reference.gdn_step_reference(**args, **heads), strict=True
        ):
            assert mx.array_equal(got, ref).item()
