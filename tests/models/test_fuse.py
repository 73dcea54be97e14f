"""Projection fusion (kapitsa.engine.loading.fuse): the fused model computes what the unfused one does."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from kapitsa.engine.loading.fuse import fuse_linears, fuse_model
from tests.models.builders import ARCHS, build_ours


def _quantize(model: nn.Module, bits: int = 4) -> None:
    nn.quantize(
        model,
        group_size=32,
        bits=bits,
        class_predicate=lambda p, m: (
            hasattr(m, "to_quantized")
            and m.weight.shape[-1] % 32 == 0
            and model.quant_predicate(p, m) is not False
        ),
    )
    mx.eval(model.parameters())


def _decode_logits(model, prompt: list[int], steps: int = 3) -> list[mx.array]:
    cache = model.make_cache(1)
    logits = model(mx.array([prompt]), cache)[:, -1]
    out = [logits]
    for _ in range(steps):
        tok = mx.argmax(logits, axis=-1)[:, None]
        logits = model(tok.astype(mx.int32), cache)[:, -1]
        out.append(logits)
    return out


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("quantized", [False, True])
def test_fused_model_matches_unfused(arch: str, quantized: bool) -> None:
    plain, fused = build_ours(arch), build_ours(arch)
    if quantized:
        _quantize(plain)
        _quantize(fused)
    n = fuse_model(fused)
    assert n > 0
    names = {k for k, _ in nn.utils.tree_flatten(fused.parameters())}
    assert any(k.endswith(("in_proj.weight", "qkv_proj.weight", "gate_up_proj.weight")) for k in names)
    assert fuse_model(fused) == 0  # idempotent
    prompt = [3, 17, 5, 9, 41, 2]
    for a, b in zip(_decode_logits(plain, prompt), _decode_logits(fused, prompt), strict=True):
        assert mx.allclose(a, b, rtol=1e-4, atol=1e-4).item(), float(mx.abs(a - b).max())


def test_fuse_refuses_mixed_formats() -> None:
    a, b = nn.Linear(64, 8, bias=False), nn.Linear(64, 8, bias=False)
    qa = nn.QuantizedLinear.from_linear(a, group_size=32, bits=4)
    qb4 = nn.QuantizedLinear.from_linear(b, group_size=32, bits=4)
    qb8 = nn.QuantizedLinear.from_linear(b, group_size=32, bits=8)
    assert fuse_linears([qa, qb8]) is None  # bits differ
    assert fuse_linears([a, qb4]) is None  # float + quantized
    assert fuse_linears([a, nn.Linear(64, 8, bias=True)]) is None  # bias differs
    x = mx.random.normal((2, 64))
    fused = fuse_linears([qa, qb4])
    assert mx.allclose(fused(x), mx.concatenate([qa(x), qb4(x)], axis=-1)).item()
