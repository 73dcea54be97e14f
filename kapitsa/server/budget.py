"""The server's reasoning budget (`kapitsa serve --reasoning-budget N`, `KAPITSA_REASONING_BUDGET`):
a cap on thinking for requests that set none of their own, so an agent's turn does not wait on a
model that thinks for thousands of tokens."""

from __future__ import annotations

from dataclasses import replace

from kapitsa.engine.types import GenerationRequest, ModelInfo


def with_reasoning_budget(
    gen: GenerationRequest, model: ModelInfo, *, reasoning: bool, budget: int | None
) -> GenerationRequest:
    """`gen` with `budget` as its reasoning budget when it has none, its output starts in reasoning
    (the template's generation prompt opens `<think>`) and the model's `</think>` is one token."""
    close = model.thinking_prompt.close_token
    if budget is None or not reasoning or close is None or gen.sampling.reasoning_budget is not None:
        return gen
    return replace(gen, sampling=replace(gen.sampling, reasoning_budget=(budget, close)))
