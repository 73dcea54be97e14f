"""A request the client gives up on, or one that fails in the server, frees its engine slot at once:
the real engine (a tiny random model that never stops by itself) behind a real uvicorn server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_harness import LiveServer, live_server

from kapitsa.engine.inprocess import InProcessEngine
from kapitsa.engine.options import EngineConfig
from kapitsa.engine.types import ModelInfo
from kapitsa.server.openai_chat import ChatChunker
from tests.engine.engine_standins import ByteTokenizer, tiny_model

ABORTED_WITHIN_S = 1.0
NEVER_ENDS = 4000  # tokens; with no EOS the engine decodes until aborted


@pytest.fixture(scope="module")
def engine() -> Iterator[InProcessEngine]:
    info = ModelInfo(id="tiny", family="test", context_length=16384, max_output_tokens=NEVER_ENDS)
    client = InProcessEngine(
        tiny_model("qwen3_5"),
        ByteTokenizer(),
        info,
        eos_token_ids=(),  # nothing but a length stop or an abort ends a generation
        config=EngineConfig(prefill_chunk=64, prefix_cache_bytes=0),
    )
    yield client
    client.close()


@pytest.fixture
def live(engine: InProcessEngine) -> Iterator[LiveServer]:
    with live_server(engine, first_event_wait_s=0.2) as server:  # type: ignore[arg-type]
        yield server


def body_for(api: str, text: str, *, stream: bool = True) -> tuple[str, dict[str, Any]]:
    messages = [{"role": "user", "content": text}]
    if api == "chat":
        return "/v1/chat/completions", {"messages": messages, "max_tokens": NEVER_ENDS, "stream": stream}
    if api == "messages":
        return "/v1/messages", {"messages": messages, "max_tokens": NEVER_ENDS, "stream": stream}
    return "/v1/responses", {"input": text, "max_output_tokens": NEVER_ENDS, "stream": stream}


async def seconds_until_idle(engine: InProcessEngine, within_s: float = ABORTED_WITHIN_S) -> float:
    """How long until the engine runs nothing; fails past `within_s`, and if it still decodes afterwards."""
    started = time.monotonic()
    while engine.stats().active_requests or engine.stats().queued_requests:
        if time.monotonic() - started > within_s:
            raise AssertionError(f"still decoding {within_s} s after the client left")
        await asyncio.sleep(0.01)
    elapsed = time.monotonic() - started
    generated = engine.stats().generated_tokens
    await asyncio.sleep(0.2)
    assert engine.stats().generated_tokens == generated
    return elapsed


@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
async def test_disconnect_mid_stream_aborts(live: LiveServer, engine: InProcessEngine, api: str) -> None:
    path, body = body_for(api, "go")
    async with httpx.AsyncClient(base_url=live.url, timeout=20) as client:
        async with client.stream("POST", path, json={"model": "tiny", **body}) as response:
            assert response.status_code == 200
            lines = 0
            async for _ in response.aiter_lines():
                lines += 1
                if lines >= 12:
                    break
            assert engine.stats().active_requests == 1  # still running when the client hangs up
        await seconds_until_idle(engine)


async def test_disconnect_during_a_long_prefill_aborts(live: LiveServer, engine: InProcessEngine) -> None:
    path, body = body_for("messages", "x" * 12000)
    async with httpx.AsyncClient(base_url=live.url, timeout=20) as client:
        async with client.stream("POST", path, json={"model": "tiny", **body}) as response:
            assert response.status_code == 200
            await asyncio.sleep(0.3)
        computed = engine.stats().prompt_tokens_computed
        await seconds_until_idle(engine)
    assert engine.stats().prompt_tokens_computed - computed < 12000


@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
async def test_client_that_stops_waiting_for_a_whole_answer_aborts(
    live: LiveServer, engine: InProcessEngine, api: str
) -> None:
    path, body = body_for(api, "go", stream=False)
    async with httpx.AsyncClient(base_url=live.url, timeout=0.5) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post(path, json={"model": "tiny", **body})
    await seconds_until_idle(engine)


async def test_a_server_error_mid_stream_aborts(
    live: LiveServer, engine: InProcessEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = 0
    real_step = ChatChunker.step

    def failing_step(self: ChatChunker, step: Any) -> list[bytes]:
        nonlocal calls
        calls += 1
        if calls > 5:
            raise RuntimeError("a bug while framing the answer")
        return real_step(self, step)

    monkeypatch.setattr(ChatChunker, "step", failing_step)
    path, body = body_for("chat", "go")
    async with httpx.AsyncClient(base_url=live.url, timeout=20) as client:
        with pytest.raises(httpx.HTTPError):
            async with client.stream("POST", path, json={"model": "tiny", **body}) as response:
                await response.aread()
    await seconds_until_idle(engine)
