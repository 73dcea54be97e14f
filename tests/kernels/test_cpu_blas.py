"""The CPU BLAS route (kernels/cpu_blas.py) against MLX's own ops: linears (dense and quantized,
with and without the kept copy) and attention (causal with an offset, grouped heads, no mask)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from kapitsa.engine.kernels import cpu_blas
from kapitsa.engine.ops import linear as qlinear
from kapitsa.engine.options import KernelOptions


def _rel_err(got: mx.array, ref: mx.array) -> float:
    return float(mx.abs(got.astype(mx.float32) - ref.astype(mx.float32)).max() / mx.abs(ref).max())


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("keep", [False, True])
def test_linear_matches_mlx(on_cpu, quantized: bool, keep: bool) -> None:
    mx.random.seed(0)
    layer = nn.Linear(128, 96, bias=True)
    if quantized:
        layer = nn.QuantizedLinear.from_linear(layer, group_size=64, bits=4)
    x = mx.random.normal((2, 40, 128))
    ref = layer(x)
    got = cpu_blas.linear(layer, x, keep=keep)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    assert _rel_err(got, ref) < 1e-5
    assert (getattr(layer, "_blas_copy", None) is not None) == keep


def test_kept_copy_follows_a_replaced_weight(on_cpu) -> None:
    layer = nn.Linear(64, 32, bias=False)
    x = mx.random.normal((20, 64))
    cpu_blas.linear(layer, x, keep=True)
    layer.weight = 2 * layer.weight
    assert _rel_err(cpu_blas.linear(layer, x, keep=True), x @ layer.weight.T) < 1e-5


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("T", "offset"), [(300, 0), (40, 1700), (513, 260), (1, 8200), (7, 2600)])
def test_attention_matches_sdpa(on_cpu, causal: bool, T: int, offset: int) -> None:
    mx.random.seed(1)
    B, H, Hkv, D = 2, 4, 2, 32
    q = mx.random.normal((B, H, T, D))
    k, v = mx.random.normal((B, Hkv, offset + T, D)), mx.random.normal((B, Hkv, offset + T, D))
    mask = "causal" if causal else None
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask=mask)
    assert cpu_blas.attention_takes(q, k, mask)
    got = cpu_blas.attention(q, k, v, scale=D**-0.5, causal=causal)
    assert _rel_err(got, ref) < 1e-4


def test_attention_declines_what_it_does_not_serve(on_cpu) -> None:
    q, k = mx.zeros((1, 2, 1, 16)), mx.zeros((1, 2, 5000, 16))
    assert not cpu_blas.attention_takes(q, k, None)  # a decode step over too little work to pay
    assert cpu_blas.attention_takes(mx.zeros((1, 16, 1, 128)), k, None)  # the same context, wider heads
    q = mx.zeros((1, 2, 64, 16))
    assert not cpu_blas.attention_takes(q, k, mx.ones((64, 5000), dtype=mx.bool_))  # an explicit mask


def test_a_decode_step_over_a_long_context_equals_mlx_attention(on_cpu) -> None:
    """One query row per sequence (decode) and a short causal chain (a verify) over 8k keys."""
    mx.random.seed(2)
    k, v = mx.random.normal((1, 1, 8192, 64)), mx.random.normal((1, 1, 8192, 64))
    for T, mask in ((1, None), (4, "causal")):
        q = mx.random.normal((1, 2, T, 64))
        assert cpu_blas.attention_takes(q, k, mask)
        ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
        got = cpu_blas.attention(q, k, v, scale=0.125, causal=mask is not None)
        assert _rel_err(got, ref) < 1e-4


def test_routed_layers_take_it_only_past_compiled_sizes(on_cpu) -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.QuantizedLinear(64, 64, group_size=64, bits=4))
    qlinear.route_quantized_linears(model, KernelOptions(), dense_copy_bytes=4 * 64 * 64)
    dense, quant = model.layers
    assert type(dense) is qlinear.RoutedLinear and type(quant) is qlinear.RoutedQuantizedLinear
    assert dense.keeps_dense_copy != quant.keeps_dense_copy  # the budget holds one copy
    few, many = mx.random.normal((cpu_blas.MIN_ROWS - 1, 64)), mx.random.normal((cpu_blas.MIN_ROWS, 64))
    dense(few)
    assert getattr(dense, "_blas_copy", None) is None  # stock path below MIN_ROWS
    assert _rel_err(dense(many), many @ dense.weight.T + dense.bias) < 1e-5
    assert (getattr(dense, "_blas_copy", None) is not None) == dense.keeps_dense_copy


def test_inside_a_compiled_function_the_ops_run(on_cpu) -> None:
    model = nn.Sequential(nn.QuantizedLinear(64, 32, group_size=64, bits=4))
    qlinear.route_quantized_linears(model, KernelOptions())
    x = mx.random.normal((1, 2 * cpu_blas.MIN_ROWS, 64))
    compiled = mx.compile(lambda h: model(h))
    assert _rel_err(compiled(x), model.layers[0](x)) < 1e-5
    q = mx.random.normal((1, 2, 64, 16))
    k = v = mx.random.normal((1, 2, 2048, 16))
    with pytest.raises(cpu_blas.Traced):
        mx.compile(lambda a, b, c: cpu_blas.attention(a, b, c, scale=0.25, causal=True))(q, k, v)


def test_rows_at_different_offsets_and_a_tree_mask_equal_mlx_attention(on_cpu) -> None:
    """A batched decode's rows see different key counts; a draft tree sees its ancestors only."""
    mx.random.seed(3)
    B, H, Hkv, D, L = 3, 8, 2, 64, 3000
    k, v = mx.random.normal((B, Hkv, L, D)), mx.random.normal((B, Hkv, L, D))
    for T in (1, 5):
        visible = mx.array([L - T - 900, L - T, 1200])[:, None] + mx.arange(T)[None, :]  # [B, T]
        mask = (mx.arange(L)[None, None, :] <= visible[..., None])[:, None]  # [B, 1, T, L]
        if T == 5:  # a tree: the last query skips its sibling at L - 2
            mask[:, :, 4, L - 2] = False
        q = mx.random.normal((B, H, T, D))
        assert cpu_blas.attention_takes(q, k, mask)
        ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
        got = cpu_blas.attention(q, k, v, scale=0.125, causal=False, mask=mask)
        assert _rel_err(got, ref) < 1e-4
