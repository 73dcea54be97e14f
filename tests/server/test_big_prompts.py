"""One big body must not stall everyone: a prompt that cannot fit is refused from its length before it
is rendered or tokenized, one that needs the exact count is tokenized off the event loop, and `/health`
answers within a second all the while. The real engine over tiny checkpoints, behind uvicorn."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_harness import LiveServer, assert_error_shape, live_server, open_tiny_engine

WINDOW = 32768  # the small checkpoint's window: it refuses more than longest-token * 32768 characters unread
TEN_MB = "word " * 2_000_000
HEALTH_WITHIN_S = 1.0


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    engine = open_tiny_engine(tmp_path_factory.mktemp("tiny") / "qwen", max_position_embeddings=WINDOW)
    try:
        with live_server(engine, first_event_wait_s=0.5) as server:
            yield server
    finally:
        engine.close()


def refused_while_healthy(url: str, path: str, body: dict[str, Any]) -> tuple[httpx.Response, float, float]:
    """POST `body` in a thread while polling `/health`: the response, its seconds, the slowest health."""
    out: dict[str, Any] = {}

    def post() -> None:
        started = time.monotonic()
        with httpx.Client(base_url=url, timeout=120) as client:
            out["response"] = client.post(path, json=body)
        out["seconds"] = time.monotonic() - started

    worker = threading.Thread(target=post)
    worker.start()
    slowest = 0.0
    with httpx.Client(base_url=url, timeout=30) as health:
        while worker.is_alive():
            started = time.monotonic()
            assert health.get("/health").status_code == 200
            slowest = max(slowest, time.monotonic() - started)
            time.sleep(0.02)
    worker.join()
    return out["response"], out["seconds"], slowest


TEN_MB_BODIES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": TEN_MB}], "max_tokens": 1},
    "/v1/messages": {"messages": [{"role": "user", "content": TEN_MB}], "max_tokens": 1, "stream": True},
    "/v1/responses": {"input": TEN_MB, "stream": True},
    "/v1/completions": {"prompt": TEN_MB, "max_tokens": 1},
    "/v1/messages/count_tokens": {"messages": [{"role": "user", "content": TEN_MB}]},
}


@pytest.mark.parametrize("path", list(TEN_MB_BODIES))
def test_a_ten_mb_prompt_is_refused_unread_and_health_stays_quick(small: LiveServer, path: str) -> None:
    response, seconds, slowest_health = refused_while_healthy(small.url, path, TEN_MB_BODIES[path])
    body = assert_error_shape(path, response, 400)
    assert seconds < 5 and slowest_health < HEALTH_WITHIN_S, (seconds, slowest_health)
    if path.startswith("/v1/messages"):  # Claude Code compacts when it reads Anthropic's own wording
        assert re.fullmatch(rf"prompt is too long: \d+ tokens > {WINDOW} maximum", body["error"]["message"])
    else:
        assert body["error"]["code"] == "context_length_exceeded"


def test_token_ids_past_the_window_are_refused_before_the_engine(small: LiveServer) -> None:
    with httpx.Client(base_url=small.url, timeout=30) as http:
        out = http.post("/v1/completions", json={"prompt": [5] * WINDOW, "max_tokens": 1})
        assert assert_error_shape("/v1/completions", out, 400)["error"]["code"] == "context_length_exceeded"
        fits = http.post("/v1/completions", json={"prompt": [5] * 100, "max_tokens": 1})
        assert fits.status_code == 200 and fits.json()["usage"]["prompt_tokens"] == 100


def test_a_prompt_under_the_bound_still_gets_its_exact_count(small: LiveServer) -> None:
    body = {"messages": [{"role": "user", "content": "ab " * 40_000}], "max_tokens": 1}
    with httpx.Client(base_url=small.url, timeout=60) as http:
        out = assert_error_shape("/v1/chat/completions", http.post("/v1/chat/completions", json=body), 400)
    assert "tokens, the model's context is 32768 tokens" in out["error"]["message"]


def test_tokenizing_a_long_prompt_leaves_the_event_loop_free(tmp_path) -> None:
    engine = open_tiny_engine(tmp_path / "qwen")  # a 262144-token window: 3 MB is read in full
    try:
        with live_server(engine) as live:
            body = {"messages": [{"role": "user", "content": "word " * 600_000}], "max_tokens": 1}
            response, seconds, slowest_health = refused_while_healthy(live.url, "/v1/chat/completions", body)
    finally:
        engine.close()
    assert (
        assert_error_shape("/v1/chat/completions", response, 400)["error"]["code"]
        == "context_length_exceeded"
    )
    # a blocked loop answers /health only when the tokenization ends (health ~ the request's time);
    # on a loaded machine the tokenization itself takes seconds, so the bound scales with it
    assert slowest_health < max(HEALTH_WITHIN_S, seconds / 3), (slowest_health, seconds)
