"""What the streams report about the prompt, on the real engine over a tiny checkpoint: Anthropic's
`message_start` carries the real prompt size (Claude Code's context meter reads it there), cache reads
and writes come from the engine's prefix cache, and a Responses stream cut by the request's own
`max_output_tokens` ends with `response.incomplete`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_harness import live_server, open_tiny_engine

SYSTEM = "You are a careful assistant. Answer in one short sentence. " * 4


@pytest.fixture(scope="module")
def http(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    engine = open_tiny_engine(tmp_path_factory.mktemp("tiny") / "qwen")
    try:
        with live_server(engine) as live, httpx.Client(base_url=live.url, timeout=60) as client:
            yield client
    finally:
        engine.close()


def sse_events(http: httpx.Client, path: str, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    out, kind = [], ""
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                out.append((kind, json.loads(line[6:])))
    return out


def streamed_usage(
    http: httpx.Client, messages: list[dict[str, Any]]
) -> tuple[dict[str, int], dict[str, int]]:
    """`message_start`'s and `message_delta`'s usage of one streamed request."""
    body = {"system": SYSTEM, "messages": messages, "max_tokens": 4}
    events = dict(sse_events(http, "/v1/messages", body))
    return events["message_start"]["message"]["usage"], events["message_delta"]["usage"]


def prompt_total(usage: dict[str, int]) -> int:
    return usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"]


def test_message_start_reports_the_prompt_and_the_cache(http: httpx.Client) -> None:
    first = [{"role": "user", "content": "Name a prime number."}]
    counted = http.post("/v1/messages/count_tokens", json={"system": SYSTEM, "messages": first}).json()
    start, final = streamed_usage(http, first)
    assert start["input_tokens"] == counted["input_tokens"] > 0
    assert start["cache_read_input_tokens"] == start["cache_creation_input_tokens"] == 0
    assert prompt_total(final) == counted["input_tokens"]
    assert final["cache_creation_input_tokens"] > 0  # the system and turn checkpoints
    assert final["input_tokens"] < counted["input_tokens"]

    later = [*first, {"role": "assistant", "content": "Seven."}, {"role": "user", "content": "Another?"}]
    counted_later = http.post("/v1/messages/count_tokens", json={"system": SYSTEM, "messages": later}).json()
    start, final = streamed_usage(http, later)
    reused = start["cache_read_input_tokens"]
    assert reused > 0  # the first turn comes back from the prefix cache
    assert prompt_total(start) == prompt_total(final) == counted_later["input_tokens"]
    assert final["cache_read_input_tokens"] == reused


def test_responses_cut_by_max_output_tokens_ends_with_response_incomplete(http: httpx.Client) -> None:
    events = sse_events(http, "/v1/responses", {"input": "Count to fifty.", "max_output_tokens": 3})
    kind, last = events[-1]
    assert kind == last["type"] == "response.incomplete"  # OpenAI's event for a length stop
    assert last["response"]["status"] == "incomplete"
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [k for k, _ in events].count("response.completed") == 0
