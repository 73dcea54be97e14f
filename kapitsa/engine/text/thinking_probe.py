"""Whether a model's output starts inside `<think>`: read from what its chat template renders.

Templates differ: Qwen3.5's generation prompt opens `<think>` unless `enable_thinking` is false, small
models' templates close an empty think block unless it is true, and some open it whatever is asked. So
the loader renders one probe conversation per `enable_thinking` value instead of reading the source.
"""

from __future__ import annotations

from typing import Any

from kapitsa.engine.text.tokenizer import Tokenizer
from kapitsa.engine.types import ThinkingPrompt
from kapitsa.errors import InvalidRequest

OPEN_TAG, CLOSE_TAG = "<think>", "</think>"
_PROBE = ({"role": "user", "content": "Hello"},)


def probe_thinking(tokenizer: Tokenizer) -> ThinkingPrompt:
    """How the template's generation prompt leaves the output, with `enable_thinking` unset, True, False.

    A template that rejects the probe counts as not thinking: a model that then writes `<think>` itself
    is still split at its leading tag, while a wrong "thinking" would hide its whole answer.
    """
    if not tokenizer.has_chat_template:
        return ThinkingPrompt()
    return ThinkingPrompt(
        by_default=_ends_inside_think(tokenizer, {}),
        when_enabled=_ends_inside_think(tokenizer, {"enable_thinking": True}),
        when_disabled=_ends_inside_think(tokenizer, {"enable_thinking": False}),
        close_token=_one_token(tokenizer, CLOSE_TAG),
    )


def _one_token(tokenizer: Tokenizer, text: str) -> int | None:
    ids = tokenizer.encode(text)
    return ids[0] if len(ids) == 1 else None


def _ends_inside_think(tokenizer: Tokenizer, kwargs: dict[str, Any]) -> bool:
    try:
        with_prompt = tokenizer.apply_chat_template(_PROBE, None, True, **kwargs)
        without = tokenizer.apply_chat_template(_PROBE, None, False, **kwargs)
    except InvalidRequest:
        return False
    # Only the generation prompt counts: a system text that mentions the tags is not an open block.
    suffix = with_prompt[len(without) :] if with_prompt.startswith(without) else with_prompt
    return suffix.rfind(OPEN_TAG) > suffix.rfind(CLOSE_TAG)
