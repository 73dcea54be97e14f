"""Concurrency, disconnects, keep-alives, shutdown drain, liveness and mid-stream failures."""

from __future__ import annotations

import asyncio
import gc
import json
import random
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from server_harness import LiveServer, live_server

from kapitsa.engine.types import ErrorEvent, Event, GenerationRequest, TokenEvent
from kapitsa.errors import ContextOverflow
from kapitsa.server.streaming import GenerationRun
from kapitsa.testing.fake_engine import FakeEngine


def echo_reply(request: GenerationRequest) -> list[str]:
    last = str((request.messages or [{}])[-1].get("content", request.prompt))
    words = (last + " done").split()
    return [f"{word}-{i} " for i, word in enumerate(words)] * 3


def body_for(api: str, text: str, **extra: Any) -> tuple[str, dict[str, Any]]:
    if api == "chat":
        return "/v1/chat/completions", {
            "model": "fake",
            "stream": True,
            "messages": [{"role": "user", "content": text}],
            **extra,
        }
    if api == "messages":
        return "/v1/messages", {
            "model": "fake",
            "stream": True,
            "max_tokens": 4000,
            "messages": [{"role": "user", "content": text}],
            **extra,
        }
    return "/v1/responses", {"model": "fake", "stream": True, "input": text, **extra}


def text_of(api: str, raw: str) -> str:
    """The answer text carried by an SSE stream of `api`."""
    out = []
    for line in raw.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        data = json.loads(line[6:])
        if api == "chat" and data.get("choices"):
            out.append(data["choices"][0]["delta"].get("content") or "")
        elif data.get("type") == "content_block_delta" and data["delta"]["type"] == "text_delta":
            out.append(data["delta"]["text"])
        elif data.get("type") == "response.output_text.delta":
            out.append(data["delta"])
    return "".join(out)


async def stream_text(client: httpx.AsyncClient, api: str, text: str) -> str:
    path, body = body_for(api, text)
    async with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        return text_of(api, (await response.aread()).decode())


async def test_eight_concurrent_streams_equal_one_by_one() -> None:
    engine = FakeEngine(responder=echo_reply)
    jobs = [
        (api, f"prompt number {i} for {api}") for i, api in enumerate(["chat", "messages", "responses"] * 3)
    ][:8]
    with live_server(engine) as live:
        async with httpx.AsyncClient(base_url=live.url, timeout=20) as client:
            alone = [await stream_text(client, api, text) for api, text in jobs]
            together = await asyncio.gather(*(stream_text(client, api, text) for api, text in jobs))
    assert list(together) == alone
    assert all("done" in t for t in alone)


class LoopSpy(FakeEngine):
    """Remembers the server's event loop, to count its tasks."""

    loop: asyncio.AbstractEventLoop | None = None

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Event]:  # type: ignore[override]
        LoopSpy.loop = asyncio.get_running_loop()
        async for event in super().generate(request):
            yield event


def server_tasks() -> int:
    loop = LoopSpy.loop
    assert loop is not None
    return asyncio.run_coroutine_threadsafe(_count_tasks(), loop).result(5)


async def _count_tasks() -> int:
    return len(asyncio.all_tasks())


async def wait_idle(engine: FakeEngine, within_s: float) -> float:
    started = time.monotonic()
    while engine.stats().active_requests:
        if time.monotonic() - started > within_s:
            raise AssertionError(f"still {engine.stats().active_requests} active after {within_s}s")
        await asyncio.sleep(0.01)
    return time.monotonic() - started


async def disconnect_at_random(client: httpx.AsyncClient, api: str, rng: random.Random) -> None:
    path, body = body_for(api, "go")
    cut_after = rng.choice([0, 1, 3, 10, 40])  # lines read before hanging up (0 = before the body)
    try:
        async with client.stream("POST", path, json=body) as response:
            lines = 0
            async for _ in response.aiter_lines():
                lines += 1
                if lines >= cut_after:
                    break
    except httpx.HTTPError:
        pass


async def test_fifty_random_disconnects_leave_nothing_running() -> None:
    rng = random.Random(7)
    engine = LoopSpy()
    with live_server(engine) as live:
        async with httpx.AsyncClient(base_url=live.url, timeout=20) as client:
            await stream_text(client, "chat", "warm up")
            baseline = server_tasks()
            for _burst in range(5):
                for _ in range(10):
                    engine.enqueue(
                        " ".join(f"w{i}" for i in range(60)),
                        delay_s=0.005,
                        prefill_s=rng.choice([0.0, 0.0, 0.3]),
                    )
                apis = [rng.choice(["chat", "messages", "responses"]) for _ in range(10)]
                await asyncio.gather(*(disconnect_at_random(client, api, rng) for api in apis))
                await wait_idle(engine, within_s=2.0)
        await asyncio.sleep(0.2)
        assert abs(server_tasks() - baseline) <= 2
        assert engine.stats().active_requests == 0
        gc.collect()
        assert not [o for o in gc.get_objects() if isinstance(o, GenerationRun)]  # every run was freed
        # The server still answers normally afterwards.
        async with httpx.AsyncClient(base_url=live.url, timeout=20) as client:
            assert "Hello" in await stream_text(client, "messages", "again")


@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
async def test_disconnect_during_prefill_aborts_within_a_second(api: str) -> None:
    engine = FakeEngine()
    engine.enqueue("never sent", prefill_s=30)
    with live_server(engine, first_event_wait_s=0.2) as live:
        async with httpx.AsyncClient(base_url=live.url, timeout=20) as client:
            path, body = body_for(api, "go")
            async with client.stream("POST", path, json=body) as response:
                assert response.status_code == 200
                await asyncio.sleep(0.5)
            elapsed = await wait_idle(engine, within_s=1.0)
    assert elapsed < 1.0


async def test_disconnect_before_headers_aborts() -> None:
    engine = FakeEngine()
    engine.enqueue("never sent", prefill_s=30)
    with live_server(engine, first_event_wait_s=10) as live:
        async with httpx.AsyncClient(base_url=live.url, timeout=0.5) as client:
            with pytest.raises(httpx.ReadTimeout):
                await client.post("/v1/chat/completions", json=body_for("chat", "go")[1])
        await wait_idle(engine, within_s=1.0)


async def test_non_stream_disconnect_aborts() -> None:
    engine = FakeEngine()
    engine.enqueue(" ".join(["word"] * 500), delay_s=0.05)
    with live_server(engine) as live:
        async with httpx.AsyncClient(base_url=live.url, timeout=0.5) as client:
            with pytest.raises(httpx.ReadTimeout):
                await client.post("/v1/messages", json={**body_for("messages", "go")[1], "stream": False})
        await wait_idle(engine, within_s=1.0)


async def test_pings_flow_during_a_long_prefill() -> None:
    engine = FakeEngine()
    engine.enqueue("late answer", prefill_s=2.0)
    with live_server(engine, keepalive_s=0.3, first_event_wait_s=0.1) as live:
        async with httpx.AsyncClient(base_url=live.url, timeout=20) as client:
            path, body = body_for("messages", "go")
            async with client.stream("POST", path, json=body) as response:
                events = [
                    line[7:]
                    for line in [x async for x in response.aiter_lines()]
                    if line.startswith("event: ")
                ]
    first_block = events.index("content_block_start")
    assert events[0] == "message_start" and events.count("ping") >= 4
    assert all(e == "ping" for e in events[1:first_block])
    assert events[-1] == "message_stop"


async def test_shutdown_drains_in_flight_streams() -> None:
    engine = FakeEngine()
    engine.enqueue(" ".join(f"w{i}" for i in range(20)), delay_s=0.05)
    with live_server(engine) as live:
        async with httpx.AsyncClient(base_url=live.url, timeout=20) as client:
            path, body = body_for("messages", "go")
            async with client.stream("POST", path, json=body) as response:
                lines = response.aiter_lines()
                first = await anext(lines)
                threading.Timer(0.05, lambda: setattr(live.server, "should_exit", True)).start()
                rest = [first] + [line async for line in lines]
    assert "event: message_stop" in rest
    assert "w19" in text_of("messages", "\n".join(rest))


def test_health_reflects_engine_liveness(live: LiveServer, http: httpx.Client) -> None:
    assert http.get("/health").json()["status"] == "ok"
    live.engine.alive = False
    response = http.get("/health")
    assert response.status_code == 503 and response.json()["status"] == "dead"


def test_metrics_are_prometheus_text(live: LiveServer, http: httpx.Client) -> None:
    http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    text = http.get("/metrics").text
    assert "# TYPE kapitsa_active_requests gauge\nkapitsa_active_requests 0\n" in text
    assert "kapitsa_requests_finished_total 1" in text and "kapitsa_alive 1" in text


class FailsMidway(FakeEngine):
    async def generate(self, request: GenerationRequest) -> AsyncIterator[Event]:  # type: ignore[override]
        yield TokenEvent(request.request_id, (1,), "partial ")
        await asyncio.sleep(0)
        yield ErrorEvent(request.request_id, self.error)

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error


class CancelledInside(FakeEngine):
    async def generate(self, request: GenerationRequest) -> AsyncIterator[Event]:  # type: ignore[override]
        yield TokenEvent(request.request_id, (1,), "partial ")
        await asyncio.sleep(0)
        raise asyncio.CancelledError  # an engine client's own future cancelled under it


def test_a_cancellation_inside_the_engine_client_ends_the_stream_with_an_error() -> None:
    """Not a stream of keep-alives for a generation that is gone: the client gets the API's error."""
    with (
        live_server(CancelledInside(), keepalive_s=0.1) as live,
        httpx.Client(base_url=live.url, timeout=10) as http,
    ):
        path, body = body_for("chat", "go")
        deadline, lines = time.monotonic() + 10, []
        with http.stream("POST", path, json=body) as response:
            for line in response.iter_lines():
                lines.append(line)
                assert time.monotonic() < deadline, "the stream did not end"
        data = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        assert "cancelled" in data[-1]["error"]["message"] and "data: [DONE]" in lines
        assert http.get("/health").status_code == 200


@pytest.mark.parametrize("error", [RuntimeError("device lost"), ContextOverflow(9000, 8192)])
def test_mid_stream_failures_use_each_api_shape(error: Exception) -> None:
    with live_server(FailsMidway(error)) as live, httpx.Client(base_url=live.url, timeout=10) as http:
        chat = http.post(*body_for("chat", "go")[:1], json=body_for("chat", "go")[1]).text.splitlines()
        data = [json.loads(x[6:]) for x in chat if x.startswith("data: {")]
        assert data[-1]["error"]["message"] and chat[-1] == "" and "data: [DONE]" in chat
        messages = http.post("/v1/messages", json=body_for("messages", "go")[1]).text
        assert "event: error" in messages and "message_stop" not in messages
        responses = http.post("/v1/responses", json=body_for("responses", "go")[1]).text
        failed = [
            json.loads(x[6:])
            for x in responses.splitlines()
            if x.startswith("data: ") and "response.failed" in x
        ]
        code = "context_length_exceeded" if isinstance(error, ContextOverflow) else "server_error"
        assert failed[-1]["response"]["error"]["code"] == code and "response.completed" not in responses


@pytest.mark.parametrize(("limit", "last_event"), [(3, "response.incomplete"), (None, "response.completed")])
def test_responses_length_stop_ends_with_incomplete_when_the_request_set_the_limit(
    live: LiveServer, http: httpx.Client, limit: int | None, last_event: str
) -> None:
    """OpenAI's `response.incomplete` for the client's own `max_output_tokens`; without one (Codex sets
    none and fails the turn on `response.incomplete`) the server's cut stays `response.completed`."""
    live.engine.enqueue("a b c d e f g h", finish_reason="length")
    raw = http.post("/v1/responses", json={"input": "go", "stream": True, "max_output_tokens": limit}).text
    events = [line[7:] for line in raw.splitlines() if line.startswith("event: ")]
    assert events[-1] == last_event and events.count(last_event) == 1
    final = json.loads([x for x in raw.splitlines() if x.startswith("data: ")][-1][6:])
    assert final["type"] == last_event and final["response"]["status"] == "incomplete"
    assert final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


async def test_keepalives_flow_while_a_long_tool_call_is_held_back() -> None:
    engine = FakeEngine()
    call = '<tool_call>{"name": "Write", "arguments": {"content": "' + "x " * 40 + '"}}</tool_call>'
    engine.enqueue("Writing " + call, delay_s=0.03)
    tools = [
        {"name": "Write", "input_schema": {"type": "object", "properties": {"content": {"type": "string"}}}}
    ]
    with live_server(engine, keepalive_s=0.2) as live:
        async with httpx.AsyncClient(base_url=live.url, timeout=20) as client:
            path, body = body_for("messages", "go", tools=tools)
            async with client.stream("POST", path, json=body) as response:
                events = [
                    line[7:]
                    for line in [x async for x in response.aiter_lines()]
                    if line.startswith("event: ")
                ]
    tool_start = max(i for i, e in enumerate(events) if e == "content_block_start")
    assert events[:tool_start].count("ping") >= 3  # ~1.2 s of held-back tool call, a ping every 0.2 s
