"""Responses' `truncation: "auto"`: a conversation past the window loses its oldest whole turns, as
few as leave room for the answer; the system prompt, the last user turn and each tool result's call
stay. Measured with a counting stand-in, then through the real server over a tiny engine."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_harness import LiveServer, assert_error_shape, live_server, open_tiny_engine

from kapitsa.engine.types import GenerationRequest, ModelInfo, SamplingParams
from kapitsa.server.input_checks import MAX_CHARS_PER_TOKEN
from kapitsa.server.truncation import fit_window

WINDOW = 1000


class CountingClient:
    """Counts a prompt as its messages' text lengths, 10 per image."""

    def __init__(self) -> None:
        self.counted: list[int] = []  # the size of each prompt counted

    async def count_tokens(self, gen: GenerationRequest) -> int:
        self.counted.append(sum(_length(m) for m in gen.messages or ()))
        return self.counted[-1]


def _length(message: dict[str, Any]) -> int:
    content = message["content"]
    if isinstance(content, str):
        return len(content)
    return sum(10 if p.get("type") == "image" else len(p.get("text", "")) for p in content)


def _model() -> ModelInfo:
    return ModelInfo(id="m", family="test", context_length=WINDOW, max_output_tokens=WINDOW)


def _turns(n: int, size: int = 100) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"role": "system", "content": "s" * 50}]
    for i in range(n):
        out += [{"role": "user", "content": f"{i}" * size}, {"role": "assistant", "content": "a" * size}]
    return [*out, {"role": "user", "content": "last" * 10}]


def _fit(messages, max_tokens: int | None = 100, images: tuple[bytes, ...] = ()) -> GenerationRequest:
    gen = GenerationRequest(
        messages=tuple(messages), images=images, sampling=SamplingParams(max_tokens=max_tokens)
    )
    return asyncio.run(fit_window(CountingClient(), gen, _model()))


def test_a_prompt_that_fits_is_left_alone() -> None:
    messages = _turns(3)
    assert _fit(messages).messages == tuple(messages)


def test_the_oldest_turns_go_until_the_answer_has_room() -> None:
    messages = _turns(8)  # 50 + 8 * 200 + 40 = 1690 > 1000
    kept = _fit(messages, max_tokens=100).messages
    assert kept[0] == messages[0] and kept[-1] == messages[-1] and kept[1]["role"] == "user"
    assert sum(_length(m) for m in kept) + 100 <= WINDOW
    one_more = messages[len(messages) - len(kept) - 1 :]  # the previous whole turn back
    assert sum(_length(m) for m in [messages[0], *one_more]) + 100 > WINDOW
    assert len(kept) == 1 + 2 * 4 + 1  # 50 + 4 turns of 200 + 40 = 890, + 100 of room


def test_the_answer_room_is_at_most_a_quarter_of_the_window() -> None:
    kept = _fit(_turns(8), max_tokens=None).messages  # the model's own limit is the whole window
    assert WINDOW - WINDOW // 4 - 200 < sum(_length(m) for m in kept) <= WINDOW - WINDOW // 4


def test_tool_results_keep_their_calls_and_dropped_images_go_with_their_turns() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x" * 700}]},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
        {"role": "tool", "content": "r" * 300},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what now"}]},
    ]
    out = _fit(messages, images=(b"first", b"second"))
    assert out.messages == (messages[-1],) and out.images == (b"second",)


def test_a_last_turn_that_cannot_fit_is_left_for_the_engine_to_refuse() -> None:
    messages = [*_turns(2), {"role": "user", "content": "z" * 2000}]
    assert _fit(messages).messages == (messages[0], messages[-1])


def test_a_turn_too_long_to_fit_is_dropped_without_being_tokenized() -> None:
    """More characters than the window's worth of the longest tokens cannot fit (input_checks.py):
    a conversation holding a huge old turn is neither counted whole nor with that turn (tokenizing
    a 30 MB input takes seconds of a core, once per step of the search)."""
    most = WINDOW * MAX_CHARS_PER_TOKEN
    huge = [{"role": "user", "content": "h" * (most + 1)}, {"role": "assistant", "content": "ok"}]
    system, *rest = _turns(2)
    messages = [system, *huge, *rest]
    client = CountingClient()
    gen = GenerationRequest(messages=tuple(messages), sampling=SamplingParams(max_tokens=100))
    out = asyncio.run(fit_window(client, gen, _model()))
    assert out.messages == (system, *rest)
    assert client.counted and max(client.counted) <= most


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    engine = open_tiny_engine(tmp_path_factory.mktemp("tiny") / "qwen", max_position_embeddings=512)
    try:
        with live_server(engine) as server:
            yield server
    finally:
        engine.close()


def _history(turns: int) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    for i in range(turns):
        items += [
            {"role": "user", "content": f"question {i} " + "word " * 30},
            {"role": "assistant", "content": f"answer {i} " + "word " * 30},
        ]
    return [*items, {"role": "user", "content": "and now?"}]


def test_the_server_answers_a_long_conversation_with_auto_truncation(small: LiveServer) -> None:
    body = {"input": _history(20), "max_output_tokens": 16, "instructions": "Be brief."}
    with httpx.Client(base_url=small.url, timeout=120) as http:
        refused = http.post("/v1/responses", json=body)
        assert_error_shape("/v1/responses", refused, 400)
        assert refused.json()["error"]["code"] == "context_length_exceeded"
        answered = http.post("/v1/responses", json={**body, "truncation": "auto"})
    assert answered.status_code == 200, answered.text
    response = answered.json()
    assert response["truncation"] == "auto" and response["output"]
    assert response["usage"]["input_tokens"] + 16 <= 512


def test_a_long_agent_turn_loses_its_oldest_tool_rounds() -> None:
    """One task, many calls: the task and the latest rounds stay, each round whole."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "s" * 50},
        {"role": "user", "content": "task"},
    ]
    for i in range(10):
        call = {"function": {"name": "read", "arguments": {"n": i}}}
        messages += [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "r" * 150},
        ]
    kept = _fit(messages, max_tokens=100).messages
    assert kept[:2] == tuple(messages[:2]) and kept[2]["role"] == "assistant" and kept[-1] == messages[-1]
    assert sum(_length(m) for m in kept) + 100 <= WINDOW  # 5 rounds of 150: 54 + 750 + 100
    assert len(kept) == 2 + 2 * 5


def test_a_prompt_that_leaves_the_answer_too_little_room_is_cut() -> None:
    messages = _turns(4)  # 50 + 800 + 40 = 890: it fits, with 110 left
    assert _fit(messages, max_tokens=100).messages == tuple(messages)
    kept = _fit(messages, max_tokens=200).messages  # the answer wants 200
    assert len(kept) < len(messages) and sum(_length(m) for m in kept) + 200 <= WINDOW
