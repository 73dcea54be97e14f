"""A `max_tokens` larger than the room the prompt leaves is clamped on every API, through the real engine;
only a prompt that does not fit by itself is a 400."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_harness import LiveServer, live_server

from kapitsa.engine.inprocess import InProcessEngine
from kapitsa.engine.loading.loader import load_model
from kapitsa.engine.options import EngineConfig

DEMO = Path(str(resources.files("kapitsa").joinpath("demo")))
WINDOW = 64  # small, so a clamped answer stays a few tokens long on a CPU
BUDGET = 32000  # what Claude Code and opencode ask for, whatever the model
ASK = [{"role": "user", "content": "def add(a, b):"}]


@pytest.fixture(scope="module")
def small_window() -> Iterator[LiveServer]:
    loaded = load_model(DEMO, model_id="demo")
    client = InProcessEngine(
        loaded.model,
        loaded.tokenizer,
        replace(loaded.info, context_length=WINDOW),
        eos_token_ids=loaded.tokenizer.eos_token_ids,
        config=EngineConfig(prefix_cache_bytes=0),
    )
    try:
        with live_server(client) as live:  # type: ignore[arg-type]
            yield live
    finally:
        client.close()


@pytest.fixture
def http(small_window: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=small_window.url, timeout=60) as client:
        yield client


def post_ok(http: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = http.post(path, json={"model": "demo", **body})
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def assert_within_window(prompt_tokens: int, completion_tokens: int) -> None:
    assert completion_tokens > 0 and prompt_tokens + completion_tokens <= WINDOW


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_chat_completions(http: httpx.Client, field: str) -> None:
    out = post_ok(http, "/v1/chat/completions", {"messages": ASK, field: BUDGET})
    assert_within_window(out["usage"]["prompt_tokens"], out["usage"]["completion_tokens"])


def test_chat_completions_stream(http: httpx.Client) -> None:
    body = {"model": "demo", "messages": ASK, "max_tokens": BUDGET, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.read().decode().rstrip().endswith("data: [DONE]")


def test_completions(http: httpx.Client) -> None:
    out = post_ok(http, "/v1/completions", {"prompt": "def add(a, b):", "max_tokens": BUDGET})
    assert_within_window(out["usage"]["prompt_tokens"], out["usage"]["completion_tokens"])


def test_responses(http: httpx.Client) -> None:
    out = post_ok(http, "/v1/responses", {"input": "def add(a, b):", "max_output_tokens": BUDGET})
    assert_within_window(out["usage"]["input_tokens"], out["usage"]["output_tokens"])


def test_anthropic_messages(http: httpx.Client) -> None:
    out = post_ok(http, "/v1/messages", {"messages": ASK, "max_tokens": BUDGET})
    usage = out["usage"]
    assert_within_window(usage["input_tokens"] + usage["cache_read_input_tokens"], usage["output_tokens"])


def test_anthropic_count_tokens(http: httpx.Client) -> None:
    out = post_ok(http, "/v1/messages/count_tokens", {"messages": ASK, "max_tokens": BUDGET})
    assert 0 < out["input_tokens"] < WINDOW


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"max_tokens": BUDGET}),
        ("/v1/messages", {"max_tokens": BUDGET}),
    ],
)
def test_a_prompt_that_does_not_fit_by_itself_is_400(http: httpx.Client, path: str, body: dict) -> None:
    long_ask = [{"role": "user", "content": "def add(a, b): return a + b\n" * 20}]
    response = http.post(path, json={"model": "demo", "messages": long_ask, **body})
    assert response.status_code == 400
    assert "prompt is too long" in response.text
