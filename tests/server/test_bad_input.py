"""Bad input → the right 4xx in each API's own error shape, never a 5xx (reliability plan T5)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from server_harness import LiveServer, live_server

from kapitsa.engine.types import Event, GenerationRequest
from kapitsa.errors import ContextOverflow, EngineBusy
from kapitsa.testing.fake_engine import FakeEngine

CHAT = "/v1/chat/completions"
MSGS = "/v1/messages"
RESP = "/v1/responses"
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with live_server(max_body_bytes=64 * 1024) as live:
        yield live


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=10) as c:
        yield c


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "fake", "messages": USER, **fields}


def msgs(**fields: Any) -> dict[str, Any]:
    return {"model": "fake", "max_tokens": 50, "messages": USER, **fields}


def _allowed_required(entry: dict[str, Any]) -> dict[str, Any]:
    """A Responses body whose one function tool is `f` and whose allowed_tools (required) list `entry`."""
    return {
        "model": "fake",
        "input": "hi",
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "allowed_tools", "mode": "required", "tools": [entry]},
    }


RAW_CASES = [  # (path, raw body, content type, status)
    (CHAT, b"{not json", "application/json", 400),
    (CHAT, b'{"model": "fake", "messages": [', "application/json", 400),
    (CHAT, b"[]", "application/json", 400),
    (CHAT, b"null", "application/json", 400),
    (CHAT, b"5", "application/json", 400),
    (
        CHAT,
        b'{"model":"fake","messages":[{"role":"user","content":"hi"}],"temperature":NaN}',
        "application/json",
        400,
    ),
    (CHAT, json.dumps(chat()).encode(), "text/plain", 415),
    (CHAT, b"a=b", "application/x-www-form-urlencoded", 415),
    (CHAT, b"", "", 415),
    (MSGS, b"{not json", "application/json", 400),
    (MSGS, b"[1, 2]", "application/json", 400),
    (MSGS, json.dumps(msgs()).encode(), "text/plain", 415),
    (RESP, b"{", "application/json", 400),
    (CHAT, b'{"messages": "' + b"x" * 70_000 + b'"}', "application/json", 413),
    (MSGS, b'{"messages": "' + b"x" * 70_000 + b'"}', "application/json", 413),
]

JSON_CASES = [  # (path, body, status, param or None)
    (CHAT, {"model": "fake"}, 400, "messages"),
    (CHAT, chat(messages=[]), 400, "messages"),
    (CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), 400, None),
    (CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, None),
    (
        CHAT,
        chat(
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]
        ),
        400,
        None,
    ),
    (CHAT, chat(max_tokens=0), 400, "max_tokens"),
    (CHAT, chat(max_tokens="many"), 400, "max_tokens"),
    (CHAT, chat(max_completion_tokens=-1), 400, "max_completion_tokens"),
    (CHAT, chat(temperature=-1), 400, "temperature"),
    (CHAT, chat(top_p=1.5), 400, "top_p"),
    (CHAT, chat(n=9), 400, "n"),
    (CHAT, chat(top_k=-1), 400, "top_k"),
    (CHAT, chat(ignore_eos="sometimes"), 400, "ignore_eos"),
    (CHAT, chat(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    (CHAT, chat(seed="x"), 400, "seed"),
    (
        CHAT,
        chat(
            tools=[{"type": "function", "function": {"name": "a"}}],
            tool_choice={"type": "function", "function": {"name": "b"}},
        ),
        400,
        "tool_choice",
    ),
    (CHAT, chat(tools="nope"), 400, "tools"),
    (
        CHAT,
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
        400,
        "response_format",
    ),
    (CHAT, chat(stop=5), 400, "stop"),
    (MSGS, {"model": "fake", "messages": USER}, 400, "max_tokens"),
    (MSGS, msgs(messages=[]), 400, "messages"),
    (MSGS, msgs(max_tokens=0), 400, "max_tokens"),
    (MSGS, msgs(temperature=3), 400, "temperature"),
    (
        MSGS,
        msgs(
            messages=[
                {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "x"}}]}
            ]
        ),
        400,
        None,
    ),
    (MSGS, msgs(messages=[{"role": "user", "content": [{"text": "no type"}]}]), 400, None),
    (MSGS, msgs(messages=[{"role": "user", "content": [{"type": "text"}]}]), 400, None),
    (MSGS, msgs(tool_choice={"type": "tool", "name": "nope"}), 400, None),
    (MSGS, msgs(system=7), 400, "system"),
    (CHAT, chat(functions=[{"name": "f", "parameters": {"type": "object"}}]), 400, "functions"),
    (CHAT, chat(function_call={"name": "f"}), 400, "function_call"),
    (
        CHAT,
        chat(
            tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
            tool_choice={
                "type": "allowed_tools",
                "allowed_tools": {
                    "mode": "required",
                    "tools": [{"type": "function", "function": {"name": "g"}}],
                },
            },
        ),
        400,
        "tool_choice",
    ),
    (RESP, _allowed_required({"type": "mcp", "server_label": "x"}), 400, "tool_choice"),  # none callable
    (CHAT, chat(modalities=["text", "audio"]), 400, "modalities"),
    (CHAT, chat(audio={"voice": "alloy", "format": "wav"}), 400, "audio"),
    ("/v1/completions", {"model": "fake", "prompt": "x", "best_of": 3}, 400, "best_of"),
    ("/v1/completions", {"model": "fake", "prompt": [5, 6, 7], "echo": True}, 400, "echo"),
    (MSGS, msgs(output_config={"format": {"type": "json_schema"}}), 400, "output_config"),
    (MSGS, msgs(output_config={"format": {"type": "yaml", "schema": {}}}), 400, "output_config"),
    (RESP, {"model": "fake", "input": [{"content": "neither type nor role"}]}, 400, None),
    (RESP, {"model": "fake", "input": "hi", "previous_response_id": "resp_1"}, 400, "previous_response_id"),
    (RESP, {"model": "fake", "input": [{"type": "message", "role": "wizard", "content": "x"}]}, 400, None),
    (RESP, {"model": "fake", "input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
    (RESP, {"model": "fake", "input": "hi", "parallel_tool_calls": "sometimes"}, 400, "parallel_tool_calls"),
    (RESP, {"model": "fake", "input": "hi", "conversation": "conv_1"}, 400, "conversation"),
    (RESP, {"model": "fake", "input": "hi", "prompt": {"id": "pmpt_1"}}, 400, "prompt"),
    (RESP, _allowed_required({"type": "function", "name": "g"}), 400, "tool_choice"),  # not a tool
    (
        RESP,
        {
            "model": "fake",
            "input": "hi",
            "tool_choice": {"type": "allowed_tools", "mode": "often", "tools": []},
        },
        400,
        "tool_choice",
    ),
    ("/v1/completions", {"model": "fake", "prompt": "x", "suffix": "y"}, 400, None),
    ("/v1/completions", {"model": "fake", "prompt": ["a", "b"]}, 400, None),
    ("/v1/completions", {"model": "fake", "prompt": ""}, 400, None),
]

NOT_FOUND = [
    (CHAT, chat(model="gpt-9")),
    (RESP, {"model": "gpt-9", "input": "hi"}),
    (MSGS, msgs(model="llama-70b")),
    ("/v1/completions", {"model": "nope", "prompt": "x"}),
]


def assert_shape(
    path: str, response: httpx.Response, status: int, param: str | None = None
) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    if path.startswith(MSGS):
        assert (
            body["type"] == "error" and set(body["error"]) == {"type", "message"} and body["error"]["message"]
        )
    else:
        assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"]
        if param is not None:
            assert body["error"]["param"] == param, body
    return body


@pytest.mark.parametrize(("path", "raw", "content_type", "status"), RAW_CASES)
def test_raw_bodies(client: httpx.Client, path: str, raw: bytes, content_type: str, status: int) -> None:
    headers = {"content-type": content_type} if content_type else {}
    assert_shape(path, client.post(path, content=raw, headers=headers), status)


@pytest.mark.parametrize(("path", "body", "status", "param"), JSON_CASES)
@pytest.mark.parametrize("stream", [False, True])
def test_invalid_json_bodies(
    client: httpx.Client, path: str, body: dict[str, Any], status: int, param: str | None, stream: bool
) -> None:
    assert_shape(path, client.post(path, json={**body, "stream": stream}), status, param)


@pytest.mark.parametrize(("path", "body"), NOT_FOUND)
def test_unknown_model_is_404(client: httpx.Client, path: str, body: dict[str, Any]) -> None:
    out = assert_shape(path, client.post(path, json=body), 404)
    kind = out["error"]["type"] if path == MSGS else out["error"]["code"]
    assert kind == ("not_found_error" if path == MSGS else "model_not_found")


@pytest.mark.parametrize("stream", [False, True])
def test_context_overflow_is_400_before_any_stream(
    server: LiveServer, client: httpx.Client, stream: bool
) -> None:
    server.engine.enqueue_error(ContextOverflow(40000, 32768))
    out = assert_shape(MSGS, client.post(MSGS, json=msgs(stream=stream)), 400)
    assert out["error"]["message"] == "prompt is too long: 40000 tokens > 32768 maximum"
    server.engine.enqueue_error(ContextOverflow(40000, 32768))
    out = assert_shape(CHAT, client.post(CHAT, json=chat(stream=stream)), 400)
    assert out["error"]["code"] == "context_length_exceeded"


def test_engine_busy_is_503_and_anthropic_529(server: LiveServer, client: httpx.Client) -> None:
    server.engine.enqueue_error(EngineBusy("no memory for this request"))
    response = client.post(MSGS, json=msgs())
    assert response.status_code == 529 and response.json()["error"]["type"] == "overloaded_error"
    assert response.headers["retry-after"]
    server.engine.enqueue_error(EngineBusy("no memory for this request"))
    assert client.post(CHAT, json=chat()).status_code == 503


@pytest.mark.parametrize("text", ["\ud800 lone surrogate", "nul \x00 byte", "x" * 60_000])
def test_odd_strings_never_5xx(client: httpx.Client, text: str) -> None:
    raw = json.dumps(chat(messages=[{"role": "user", "content": text}])).encode()
    assert client.post(CHAT, content=raw, headers={"content-type": "application/json"}).status_code in (
        200,
        400,
        413,
    )


def test_unknown_fields_and_claude_extras_are_ignored(client: httpx.Client) -> None:
    body = msgs(
        thinking={"type": "adaptive"},
        context_management={"edits": []},
        output_config={"effort": "high"},
        metadata={"user_id": "{}"},
        brand_new_field=[1, 2],
    )
    headers = {"anthropic-beta": "made-up-2099-01-01", "anthropic-version": "2023-06-01"}
    assert client.post(MSGS + "?beta=true", json=body, headers=headers).status_code == 200
    assert (
        client.post(
            CHAT, json=chat(store=False, reasoning_effort="high", parallel_tool_calls=True, whatever=1)
        ).status_code
        == 200
    )


class WindowedEngine(FakeEngine):
    """Refuses a prompt plus max_tokens beyond the window (the in-process engine clamps it by itself)."""

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Event]:  # type: ignore[override]
        prompt = await self.count_tokens(request)
        window = self.model.context_length
        if prompt >= window or (request.sampling.max_tokens or 0) + prompt > window:
            raise ContextOverflow(prompt, window, f"prompt ({prompt}) plus max_tokens does not fit {window}")
        async for event in super().generate(request):
            yield event


def test_max_tokens_beyond_the_room_left_is_clamped_not_refused() -> None:
    engine = WindowedEngine().with_model(context_length=400)
    engine.enqueue(" ".join(["word"] * 200))
    with live_server(engine) as live, httpx.Client(base_url=live.url, timeout=10) as http:
        out = http.post(MSGS, json=msgs(max_tokens=32000))  # Claude Code style: a fixed, large budget
        assert out.status_code == 200, out.text
        assert out.json()["stop_reason"] == "max_tokens"
        assert engine.requests[-1].sampling.max_tokens == 400 - out.json()["usage"]["input_tokens"]
        engine.enqueue(" ".join(["word"] * 200))
        huge = http.post(CHAT, json=chat(max_tokens=10_000_000))
        assert huge.status_code == 200, huge.text
        assert huge.json()["choices"][0]["finish_reason"] == "length"
        long_prompt = msgs(messages=[{"role": "user", "content": "x" * 500}])
        refused = http.post(MSGS, json=long_prompt)
        assert refused.status_code == 400
        assert refused.json()["error"]["message"].startswith("prompt is too long: ")
        assert refused.json()["error"]["message"].endswith(" tokens > 400 maximum")


def test_unknown_block_and_item_types_from_newer_clients_are_skipped(client: httpx.Client) -> None:
    future_block = {"type": "connector_text_2099", "text": "?"}
    body = msgs(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}, future_block]}])
    assert client.post(MSGS, json=body).status_code == 200
    items = [
        {"type": "message", "role": "user", "content": "hi"},
        {"type": "tool_search_call_2099", "id": "x"},
    ]
    assert client.post(RESP, json={"model": "fake", "input": items}).status_code == 200


def test_more_than_ten_thousand_messages_is_400() -> None:
    many = [{"role": "user", "content": "x"}] * 10_001
    with live_server() as live, httpx.Client(base_url=live.url, timeout=10) as client:
        assert_shape(CHAT, client.post(CHAT, json=chat(messages=many)), 400, "messages")
        assert_shape(MSGS, client.post(MSGS, json=msgs(messages=many)), 400)
        assert_shape(RESP, client.post(RESP, json={"model": "fake", "input": many}), 400, "input")
