"""The decode strategy's draft model gets the engine's kernel options, as the target does."""

from __future__ import annotations

import pytest

from kapitsa.engine.options import KernelOptions
from kapitsa.engine.speculative.factory import make_decode_strategy
from tests.models.builders import build_ours


def _options_of(model) -> set[KernelOptions]:
    return {m.kernel_options for _, m in model.named_modules() if hasattr(type(m), "kernel_options")}


def test_a_draft_model_takes_the_engines_kernel_options() -> None:
    draft = build_ours("qwen3_5_moe")
    assert _options_of(draft) == {KernelOptions()}
    options = KernelOptions(families=frozenset({"gdn"}), compile_decode=False)
    strategy = make_decode_strategy("draft", draft_model=draft, kernels=options)
    assert strategy.name == "draft"
    assert _options_of(draft) == {options}


def test_without_engine_options_a_draft_model_keeps_its_own() -> None:
    draft = build_ours("nemotron_moe")
    make_decode_strategy("draft", draft_model=draft)
    assert _options_of(draft) == {KernelOptions()}


def test_the_served_strategy_prices_verifies_by_timing_the_model_on_the_cpu() -> None:
    """On the CPU the opener's strategy carries a cost curve timed on the served model (a small
    model's verify costs about T decode steps there), not the bandwidth-only default."""
    import mlx.core as mx

    from kapitsa.engine.speculative.controller import default_cost_curve
    from kapitsa.engine.speculative.factory import strategy_for

    if mx.default_device().type == mx.DeviceType.gpu:
        pytest.skip("GPUs use the curve measured on the H200")
    strategy = strategy_for("auto", target_model=build_ours("qwen3_5_dense"))
    curve = strategy.cost_curve
    assert curve is not None and len(curve) == strategy.max_draft + 1 and curve[0] == 1.0
    assert curve == sorted(curve) and curve != default_cost_curve(strategy.max_draft)
