"""A prefilled answer: the client's final assistant message, which the output continues (the
Messages API's prefill, vLLM's `continue_final_message` on chat completions). Pure functions."""

from __future__ import annotations

from kapitsa.engine.types import ModelInfo
from kapitsa.server.errors import param_error
from kapitsa.server.reasoning import CLOSE_TAG, OPEN_TAG


def opens_reasoning(prefill: str) -> bool:
    """Whether the output continues inside reasoning: the prefill opened `<think>` and left it open."""
    return prefill.rfind(OPEN_TAG) > prefill.rfind(CLOSE_TAG)


def continues(prefill: str | None) -> bool:
    """Whether a prefill leaves text to continue: a blank one is answered afresh, after the generation
    prompt (as the engine's `conversation` renders it)."""
    return bool(prefill and prefill.strip())


def starts_in_reasoning(
    model: ModelInfo, thinking: bool | None, prefill: str | None, *, generation_prompt: bool = True
) -> bool:
    """Where the output starts: after a prefill, where the prefill left it; after a closed message (no
    generation prompt, chat's `add_generation_prompt: false`), outside reasoning; else where the
    template's generation prompt, rendered with this `enable_thinking`, leaves it (probed at load time)."""
    if continues(prefill):
        return opens_reasoning(prefill)
    if not generation_prompt:
        return False
    return model.thinking_prompt.starts_in_reasoning(thinking)


def check_unforced(prefill: str, *, forced: bool, field: str) -> None:
    """A grammar that holds the whole answer (a required call, a JSON format) starts at the answer's
    first token, so it cannot follow text the client already wrote."""
    if continues(prefill) and forced:
        raise param_error(
            field,
            "A prefilled assistant message cannot be continued under a required tool call or a JSON "
            "format: the format holds the whole answer from its start.",
        )
