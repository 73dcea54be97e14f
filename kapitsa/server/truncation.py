"""Responses' `truncation: "auto"`: a conversation that leaves the answer too little room in the
model's window loses its oldest parts, whole, until it fits with room for an answer. First the
oldest turns go (a shorter conversation starts at a user message); then, within the last user turn,
the oldest tool rounds after its message (an agent's long turn: one task, many calls), each round
an assistant message with the tool results that answer it, so no result loses its call. The system
prompt, the last user message and the latest round always stay."""

from __future__ import annotations

import dataclasses
from itertools import accumulate
from typing import Any

from kapitsa.engine.client import EngineClient
from kapitsa.engine.types import MAX_CHARS_PER_TOKEN, GenerationRequest, ModelInfo

ANSWER_SHARE = 4  # the room kept for the answer: at most a quarter of the window


async def fit_window(client: EngineClient, gen: GenerationRequest, model: ModelInfo) -> GenerationRequest:
    """`gen` as it is when its prompt leaves room for `max_tokens` (or the model's own limit, at most
    a quarter of the window: the room an answer gets); else with as little dropped as leaves that
    room. When even the shortest cut does not fit, that cut, for the engine to refuse.

    A conversation of more characters than the window's worth of the longest tokens cannot fit
    (input_checks.py): it is not tokenized, so a huge input costs no more counting than one that
    may fit."""
    window = model.context_length
    room = min(gen.sampling.max_tokens or model.max_output_tokens, window // ANSWER_SHARE)
    most_chars = window * (model.max_token_bytes or MAX_CHARS_PER_TOKEN)
    messages = list(gen.messages or ())
    chars = [_chars(m) for m in messages]
    if sum(chars) <= most_chars and await client.count_tokens(gen) + room <= window:
        return gen
    cuts = _cuts(messages)  # each keeps less than the one before
    if not cuts:
        return gen
    # the first cut that may fit: those before it hold more characters than any fitting prompt
    low = next((n for n, keep in enumerate(cuts) if sum(chars[i] for i in keep) <= most_chars), len(cuts))
    high, best = len(cuts) - 1, None
    while low <= high:  # the earliest cut that fits keeps the most
        middle = (low + high) // 2
        shorter = _keeping(gen, messages, cuts[middle])
        if await client.count_tokens(shorter) + room <= window:
            best, high = shorter, middle - 1
        else:
            low = middle + 1
    return best if best is not None else _keeping(gen, messages, cuts[-1])


def _cuts(messages: list[dict[str, Any]]) -> list[list[int]]:
    """The messages each shorter conversation keeps, longest first: from each later user message on,
    then the last user message with each later tool round on."""
    head = [0] if messages and messages[0].get("role") == "system" else []
    users = [i for i in range(len(head), len(messages)) if messages[i].get("role") == "user"]
    if not users:
        return []
    last = users[-1]
    cuts = [[*head, *range(start, len(messages))] for start in users if start > len(head)]
    rounds = [i for i in range(last + 1, len(messages)) if messages[i].get("role") == "assistant"]
    cuts += [[*head, last, *range(start, len(messages))] for start in rounds[1:]]
    return cuts


def _keeping(gen: GenerationRequest, messages: list[dict[str, Any]], keep: list[int]) -> GenerationRequest:
    """`gen` with only the messages at `keep`, and only their images."""
    firsts = [0, *accumulate(_images_in(m) for m in messages)]  # each message's first image
    images = tuple(image for i in keep for image in gen.images[firsts[i] : firsts[i + 1]])
    return dataclasses.replace(gen, messages=tuple(messages[i] for i in keep), images=images)


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
