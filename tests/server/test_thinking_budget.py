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


@pytest.fixture(scope="module")
def capped() -> Iterator[LiveServer]:
    """The demo behind a server whose settings cap thinking (`--reasoning-budget`)."""
    yield from serve(DEMO, "demo", reasoning_budget=BUDGET)


def test_the_servers_budget_caps_thinking_on_every_api(capped: LiveServer, demo: LiveServer) -> None:
    tokenizer = Tokenizer.from_folder(DEMO)
    free = _message(demo, {"type": "enabled"})["content"][0]["thinking"]
    assert len(tokenizer.encode(free)) > BUDGET
    held = _message(capped, {"type": "enabled"})
    assert len(tokenizer.encode(held["content"][0]["thinking"])) <= BUDGET and held["content"][1]["text"]
    # a request's own budget wins over the server's
    own = _message(capped, {"type": "enabled", "budget_tokens": 1024})["content"][0]["thinking"]
    assert own == free
    body = {
        "model": "demo",
        "max_tokens": 48,
        "temperature": 0,
        "messages": ASK,
        "chat_template_kwargs": {"enable_thinking": True},
    }
    chat = httpx.post(capped.v1 + "/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
    assert len(tokenizer.encode(chat["reasoning_content"])) <= BUDGET and chat["content"]
    body = {"model": "demo", "input": ASK[0]["content"], "max_output_tokens": 48, "temperature": 0}
    body["reasoning"] = {"effort": "medium"}
    output = httpx.post(capped.v1 + "/responses", json=body, timeout=60).json()["output"]
    thought = "".join(c["text"] for item in output if item["type"] == "reasoning" for c in item["content"])
    assert 0 < len(tokenizer.encode(thought)) <= BUDGET
