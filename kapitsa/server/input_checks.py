"""Checks at the API edge that keep hostile values from the engine: token ids and logit biases outside
the vocabulary, and prompts so long that they cannot fit, refused before they are rendered or tokenized
(tokenizing a 10 MB prompt takes seconds of a core)."""

from __future__ import annotations

import re
from collections.abc import Sequence

from kapitsa.engine import check_token_ids
from kapitsa.engine.types import MAX_CHARS_PER_TOKEN, GenerationRequest, ModelInfo
from kapitsa.errors import ContextOverflow, InvalidRequest
from kapitsa.server.errors import param_error

MAX_LOGIT_BIAS = 100.0  # OpenAI's range: -100 bans a token, 100 forces it


def check_prompt_ids(ids: Sequence[int], model: ModelInfo) -> None:
    """A token-id prompt (`/v1/completions`) must name rows of the model's vocabulary."""
    try:
        check_token_ids(ids, model.vocab_size, where="`prompt`")
    except InvalidRequest as err:
        raise param_error("prompt", str(err)) from None


def _token_id_key(key: str) -> int | None:
    """A `logit_bias` key as an integer token id: ASCII digits with an optional minus sign, short
    enough to be an id (so `"²"`, `"--5"` or thousands of digits are refused, not a 500)."""
    match = re.fullmatch(r"\s*(-?[0-9]{1,12})\s*", key)
    return int(match.group(1)) if match else None


def logit_bias_pairs(bias: dict[str, float] | None, model: ModelInfo) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias` ({"token id": bias}) as (id, bias) pairs; a bad id or bias is a 400."""
    if not bias:
        return ()
    pairs = []
    for key, value in bias.items():
        token_id = _token_id_key(key)
        if token_id is None:
            raise param_error("logit_bias", f"logit_bias keys are token ids; {key!r} is not an integer.")
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise param_error("logit_bias", f"logit_bias values lie in [-100, 100]; {key!r} has {value}.")
        pairs.append((token_id, float(value)))
    try:
        check_token_ids([i for i, _ in pairs], model.vocab_size, where="`logit_bias`")
    except InvalidRequest as err:
        raise param_error("logit_bias", str(err)) from None
    return tuple(pairs)


def prompt_chars(request: GenerationRequest) -> int:
    """Characters the rendered prompt holds at least: the prompt, or every message's content (templates
    may drop old reasoning, never content)."""
    if request.prompt is not None:
        return len(request.prompt)
    return sum(len(m["content"]) for m in request.messages or () if isinstance(m.get("content"), str))


def check_prompt_size(request: GenerationRequest, model: ModelInfo) -> None:
    """Refuse, from its length alone, a prompt that cannot fit the window (`ContextOverflow`, so clients
    that compact on "prompt is too long" do). Prompts that may fit are left to the engine's exact count."""
    window = model.context_length
    if request.prompt_token_ids is not None and len(request.prompt_token_ids) >= window:
        count = len(request.prompt_token_ids)
        raise ContextOverflow(
            count, window, f"prompt is too long: {count} tokens, the model's context is {window}"
        )
    chars = prompt_chars(request)
    longest = model.max_token_bytes or MAX_CHARS_PER_TOKEN
    if chars > window * longest:
        at_least = chars // longest
        raise ContextOverflow(
            at_least,
            window,
            f"prompt is too long: {chars} characters are at least {at_least} tokens, the model's context "
            f"is {window} tokens",
        )
