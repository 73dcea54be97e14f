"""The decode strategy's draft model gets the engine's kernel options, as the target does."""

from __future__ import annotations

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
