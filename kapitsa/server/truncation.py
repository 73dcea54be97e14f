"""Responses' `truncation: "auto"`: a conversation that does not fit the model's window loses its
oldest turns, whole, until it fits with room for an answer. The system prompt and the last user turn
always stay; a shorter conversation always starts at a user message, so no tool result is left
without its call."""

from __future__ import annotations

import dataclasses
from typing import Any

from kapitsa.engine.client import EngineClient
from kapitsa.engine.types import GenerationRequest, ModelInfo

ANSWER_SHARE = 4  # the room kept for the answer: at most a quarter of the window


async def fit_window(client: EngineClient, gen: GenerationRequest, model: ModelInfo) -> GenerationRequest:
    """`gen` as it is when its prompt fits the window; else without its oldest turns, as few dropped
    as leave room for `max_tokens` (or the model's own limit), at most a quarter of the window. When
    even the last user turn does not fit, that turn alone, for the engine to refuse."""
    window = model.context_length
    if await client.count_tokens(gen) < window:
        return gen
    room = min(gen.sampling.max_tokens or model.max_output_tokens, window // ANSWER_SHARE)
    messages = list(gen.messages or ())
    head = 1 if messages and messages[0].get("role") == "system" else 0
    starts = [i for i in range(head + 1, len(messages)) if messages[i].get("role") == "user"]
    if not starts:
        return gen
    low, high, best = 0, len(starts) - 1, None
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


def _images_in(message: dict[str, Any]) -> int:
    content = message.get("content")
    if not isinstance(content, list):
        return 0
    return sum(1 for part in content if isinstance(part, dict) and part.get("type") == "image")
