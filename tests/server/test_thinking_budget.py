"""Anthropic's `thinking.budget_tokens` on the real demo: the thinking block stops at the budget and
the answer follows; without thinking the budget changes nothing; a budget that is not a positive
integer is a 400."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from server_harness import LiveServer
from test_demo_answers import ASK, DEMO, serve

from kapitsa.engine.text.tokenizer import Tokenizer

BUDGET = 6


@pytest.fixture(scope="module")
def demo() -> Iterator[LiveServer]:
    yield from serve(DEMO, "demo")


def _message(live: LiveServer, thinking: dict | None) -> dict:
    body = {"model": "demo", "max_tokens": 48, "temperature": 0, "messages": ASK}
    if thinking is not None:
        body["thinking"] = thinking
    reply = httpx.post(live.url + "/v1/messages", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_the_thinking_block_stops_at_the_budget(demo: LiveServer) -> None:
    free = _message(demo, {"type": "enabled", "budget_tokens": 1024})
    held = _message(demo, {"type": "enabled", "budget_tokens": BUDGET})
    tokenizer = Tokenizer.from_folder(DEMO)
    free_thought, held_thought = free["content"][0]["thinking"], held["content"][0]["thinking"]
    assert len(tokenizer.encode(free_thought)) > BUDGET  # the demo thinks longer when let
    assert len(tokenizer.encode(held_thought)) <= BUDGET and free_thought.startswith(held_thought)
    assert [b["type"] for b in held["content"]] == ["thinking", "text"] and held["content"][1]["text"]


def test_without_thinking_the_budget_changes_nothing(demo: LiveServer) -> None:
    plain = _message(demo, {"type": "disabled"})
    assert _message(demo, {"type": "disabled", "budget_tokens": 2})["content"] == plain["content"]


@pytest.mark.parametrize("budget", [0, -5, "1024", 2.5, True])
def test_a_budget_that_is_not_a_positive_integer_is_a_400(demo: LiveServer, budget) -> None:
    body = {
        "model": "demo",
        "max_tokens": 8,
        "messages": ASK,
        "thinking": {"type": "enabled", "budget_tokens": budget},
    }
    reply = httpx.post(demo.url + "/v1/messages", json=body, timeout=30)
    assert reply.status_code == 400 and "budget_tokens" in reply.json()["error"]["message"]
