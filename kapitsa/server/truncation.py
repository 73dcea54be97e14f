"""Responses' `truncation: "auto"`: a conversation that does not fit the model's window loses its
oldest turns, whole, until it fits with room for an answer. The system prompt and the last user turn
always stay; a shorter conversation always starts at a user message, so no tool result is left
without its call."""

from __future__ import annotations

import dataclasses
from itertools import accumulate
from typing import Any

from kapitsa.engine.client import EngineClient
from kapitsa.engine.types import GenerationRequest, ModelInfo
from kapitsa.server.input_checks import MAX_CHARS_PER_TOKEN

ANSWER_SHARE = 4  # the room kept for the answer: at most a quarter of the window


async def fit_window(client: EngineClient, gen: GenerationRequest, model: ModelInfo) -> GenerationRequest:
    """`gen` as it is when its prompt fits the window; else without its oldest turns, as few dropped
    as leave room for `max_tokens` (or the model's own limit), at most a quarter of the window. When
    even the last user turn does not fit, that turn alone, for the engine to refuse.

    A conversation of more characters than the window's worth of the longest tokens cannot fit
    (input_checks.py): it is not tokenized, so a huge input costs no more counting than one that
    may fit."""
    window = model.context_length
    most_chars = window * (model.max_token_bytes or MAX_CHARS_PER_TOKEN)
    messages = list(gen.messages or ())
    head = 1 if messages and messages[0].get("role") == "system" else 0
    # the characters the prompt holds at least from each message on: their text
    after = [*accumulate((_chars(m) for m in reversed(messages)), initial=0)][::-1]
    if after[0] <= most_chars and await client.count_tokens(gen) < window:
        return gen
    room = min(gen.sampling.max_tokens or model.max_output_tokens, window // ANSWER_SHARE)
    starts = [i for i in range(head + 1, len(messages)) if messages[i].get("role") == "user"]
    if not starts:
        return gen
    system = after[0] - after[head]
    # the earliest start that may fit: starts before it hold more characters than any fitting prompt
    low = next((k for k, i in enumerate(starts) if system + after[i] <= most_chars), len(starts))
    high, best = len(starts) - 1, None
    while low <= high:  # the earliest start that fits keeps the most history
        middle = (low + high) // 2
        shorter = _from(gen, messages, head, starts[middle])
        if await client.count_tokens(shorter) + room <= window:
            best, high = shorter, middle - 1
        else:
            low = middle + 1
    return best if best is not None else _from(gen, messages, head, starts[-1])


def _from(gen: GenerationRequest, messages: list[dict[str, Any]], head: int, start: int) -> GenerationRequest:
    """`gen` with the messages between its system prompt and `start` dropped, and their images."""
    dropped = sum(_images_in(m) for m in messages[head:start])
    return dataclasses.replace(
        gen, messages=(*messages[:head], *messages[start:]), images=gen.images[dropped:]
    )


def _chars(message: dict[str, Any]) -> int:
    """The characters of a message's text: the rendered prompt holds them at least."""
    content = message.get("content")
    if isinstance(content, str):
        return len(content)
    if not isinstance(content, list):
        return 0
    return sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))


def _images_in(message: dict[str, Any]) -> int:
    content = message.get("content")
    if not isinstance(content, list):
        return 0
    return sum(1 for part in content if isinstance(part, dict) and part.get("type") == "image")
