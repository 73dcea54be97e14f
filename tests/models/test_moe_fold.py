"""Shared experts folded into the routed stacks (kapitsa.engine.loading.moe_fold): exact, and only where
the formats allow."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from kapitsa.engine.loading import moe_fold
from kapitsa.engine.loading.fuse import fuse_model
from kapitsa.engine.ops.moe import QuantizedSwitchLinear
from kapitsa.engine.options import KernelOptions
from tests.models.builders import build_ours
from tests.models.test_fuse import _decode_logits, _quantize

FOLDING = KernelOptions(fold_shared_experts=True)  # folding is opt-in (the default options keep it off)


def _qlinear(out_dims: int, in_dims: int, bits: int = 4, group_size: int = 32) -> nn.QuantizedLinear:
    mx.random.seed(3)
    return nn.QuantizedLinear.from_linear(nn.Linear(in_dims, out_dims, bias=False), group_size, bits)


@pytest.mark.parametrize("bits,group_size", [(4, 32), (8, 64)])
def test_row_and_column_blocks_recompose_the_linear(bits: int, group_size: int) -> None:
    linear = _qlinear(96, 256, bits, group_size)
    x = mx.random.normal((3, 256))
    rows = moe_fold.split_rows(linear, 3)
    assert mx.array_equal(mx.concatenate([r(x) for r in rows], axis=-1), linear(x)).item()
    cols = moe_fold.split_columns(linear, 2)
    summed = cols[0](x[:, :128]) + cols[1](x[:, 128:])
    assert mx.allclose(summed, linear(x), atol=1e-4).item()
    assert moe_fold.split_rows(linear, 5) is None  # 96 rows don't split five ways
    assert (
        moe_fold.split_columns(linear, 16 if group_size == 32 else 8) is None
    )  # 16 or 32 columns: part of a group


def _moe_blocks(model) -> list[nn.Module]:
    return [m for _, m in model.named_modules() if "switch_mlp" in m]


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "qwen3_next", "nemotron_moe"])
def test_folded_shared_experts_are_extra_experts_of_the_stacks(arch: str) -> None:
    plain, folded = build_ours(arch), build_ours(arch, kernels=FOLDING)
    _quantize(plain)
    _quantize(folded)
    experts = [b.switch_mlp for b in _moe_blocks(folded)]
    before = [len(s["fc1" if "fc1" in s else "gate_proj"]["weight"]) for s in experts]
    fuse_model(folded)
    for block, count in zip(_moe_blocks(folded), before, strict=True):
        first, pieces = block.__dict__["shared_fold"]
        assert first == count and pieces == 2  # the tiny configs' shared MLP is twice an expert
        assert "shared_expert" not in block and "shared_experts" not in block
        stack = block.switch_mlp["fc1" if "fc1" in block.switch_mlp else "gate_proj"]
        assert isinstance(stack, QuantizedSwitchLinear) and len(stack["weight"]) == count + pieces
    prompt = [3, 17, 5, 9, 41, 2]
    for a, b in zip(_decode_logits(plain, prompt), _decode_logits(folded, prompt), strict=True):
        assert mx.allclose(a, b, rtol=1e-4, atol=1e-4).item(), float(mx.abs(a - b).max())


def test_no_fold_when_switched_off_unquantized_or_latent() -> None:
    for arch, quantized in (("nemotron_moe", False), ("nemotron_latent", True)):
        model = build_ours(arch, kernels=FOLDING)
        if quantized:
            _quantize(model)
        fuse_model(model)
        assert all("shared_fold" not in b.__dict__ for b in _moe_blocks(model)), arch
    model = build_ours("qwen3_5_moe")  # the default options
    _quantize(model)
    fuse_model(model)
    assert all("shared_fold" not in b.__dict__ and "shared_expert" in b for b in _moe_blocks(model))


def test_a_shared_expert_in_another_format_stays_separate() -> None:
    """A shared expert kept at 8 bits next to 4-bit experts is left alone, and still right."""
    plain, model = build_ours("qwen3_5_moe"), build_ours("qwen3_5_moe", kernels=FOLDING)
    for m in (plain, model):
        _quantize(m)
        for block in _moe_blocks(m):
            mx.random.seed(5)
            block.shared_expert = type(block.shared_expert)(*_shared_dims(block))
            nn.quantize(block.shared_expert, group_size=32, bits=8)
            mx.eval(block.shared_expert.parameters())
    fuse_model(model)
    assert all("shared_fold" not in b.__dict__ for b in _moe_blocks(model))
    prompt = [3, 17, 5, 9]
    for a, b in zip(_decode_logits(plain, prompt, 1), _decode_logits(model, prompt, 1), strict=True):
        assert mx.allclose(a, b, rtol=1e-4, atol=1e-4).item()


def _shared_dims(block) -> tuple[int, int]:
    down = block.shared_expert.down_proj
    return down["scales"].shape[0], down["weight"].shape[1] * 32 // down.bits


def test_shared_slots_append_fixed_experts_to_every_row() -> None:
    inds = mx.array([[[4, 1]], [[0, 2]]], dtype=mx.uint32)
    scores = mx.array([[[0.75, 0.25]], [[0.5, 0.5]]])
    got_inds, got_scores = moe_fold.shared_slots(inds, scores, 8, 2, mx.array([[[0.25]], [[0.75]]]))
    assert got_inds.dtype == mx.uint32 and got_inds.tolist() == [[[4, 1, 8, 9]], [[0, 2, 8, 9]]]
    assert got_scores.tolist() == [[[0.75, 0.25, 0.25, 0.25]], [[0.5, 0.5, 0.75, 0.75]]]
    _, ones = moe_fold.shared_slots(inds, scores, 8, 1, 1.0)
    assert ones[..., -1].tolist() == [[1.0], [1.0]]


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "nemotron_moe"])
def test_a_folded_model_routes_its_shared_experts_through_the_router_kernel(monkeypatch, arch: str) -> None:
    """With the "route" family on (the reference standing in for the kernel), a folded model's
    router is asked for the shared slots, and its logits equal the op path's."""
    from kapitsa.engine.kernels import router
    from tests.models.builders import logits_under_families

    asked = []

    def kernel(x, weight, **kw):
        asked.append(kw.get("shared"))
        return router.route_reference(x, weight, **kw)

    monkeypatch.setattr(router, "route_kernel", kernel)
    monkeypatch.setattr(router, "supports", lambda *a, **k: True)
    monkeypatch.setitem(router.WORKING, "router", True)
    model = build_ours(arch, kernels=FOLDING)
    _quantize(model)
    fuse_model(model)
    folds = {block.__dict__["shared_fold"] for block in _moe_blocks(model)}
    plain = logits_under_families(model, monkeypatch, "gdn,moe,qmv,mamba")
    assert asked == []
    routed = logits_under_families(model, monkeypatch, "gdn,moe,qmv,mamba,route")
    assert asked and set(asked) == folds
    for a, b in zip(plain, routed, strict=True):
        assert mx.allclose(a, b, atol=1e-4, rtol=1e-4).item(), float(mx.abs(a - b).max())
