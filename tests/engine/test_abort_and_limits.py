"""Aborts release everything and leave neighbours alone; limits fail fast with clear errors."""

from __future__ import annotations

import asyncio
import gc
import threading
import time

import mlx.core as mx
import pytest
from engine_standins import EOS, ByteTokenizer

from kapitsa.engine.inprocess import InProcessEngine
from kapitsa.engine.options import EngineConfig
from kapitsa.engine.types import (
    ErrorEvent,
    FinishEvent,
    GenerationRequest,
    ModelInfo,
    PrefillProgressEvent,
    SamplingParams,
    TokenEvent,
)
from kapitsa.errors import ContextOverflow, EngineBusy

LONG_PROMPT = "A prompt long enough to need many prefill chunks. " * 12


async def collect(client, request):
    ids, events = [], []
    async for event in client.generate(request):
        events.append(event)
        if isinstance(event, TokenEvent):
            ids.extend(event.token_ids)
    return ids, events


def _req(prompt: str, n: int, **kw) -> GenerationRequest:
    return GenerationRequest(prompt=prompt, sampling=SamplingParams(max_tokens=n, ignore_eos=True, **kw))


async def _abort_after(client, request, *, when) -> list:
    """Run `request`, abort it at the first event for which `when(event)` holds; return its events."""
    events = []
    async for event in client.generate(request):
        events.append(event)
        if when(event):
            await client.abort(request.request_id)
    return events


async def _settle(client) -> int:
    for _ in range(200):  # the stats show no request a moment before the engine thread drops the batch
        idle = client.stats().active_requests == 0 and client.stats().queued_requests == 0
        if idle and client.engine.batch.cache is None:
            break
        await asyncio.sleep(0.01)
    gc.collect()
    return mx.get_active_memory()


async def test_abort_mid_prefill_and_mid_decode_frees_memory(family_model, make_client) -> None:
    client = make_client(family_model, prefill_chunk=32, prefix_cache_bytes=0)
    alone, _ = await collect(client, _req("neighbour", 30))
    baseline = await _settle(client)
    neighbour = asyncio.create_task(collect(client, _req("neighbour", 30)))
    mid_prefill = _abort_after(
        client, _req(LONG_PROMPT, 20), when=lambda e: isinstance(e, PrefillProgressEvent)
    )
    decoded, held = [], []

    def third_token(event) -> bool:
        if isinstance(event, TokenEvent):
            decoded.append(event)
            held.append(mx.get_active_memory())  # while the three requests hold their caches
        return len(decoded) == 3 and isinstance(event, TokenEvent)

    mid_decode = _abort_after(client, _req("decode me", 100), when=third_token)
    prefill_events, decode_events = await asyncio.gather(mid_prefill, mid_decode)
    assert prefill_events[-1].finish_reason == "abort" and not any(
        isinstance(e, TokenEvent) for e in prefill_events
    )
    assert decode_events[-1].finish_reason == "abort"
    assert 3 <= decode_events[-1].usage.completion_tokens < 100
    ids, events = await neighbour
    assert ids == alone and events[-1].finish_reason == "length"
    # A few bytes of bookkeeping (PRNG keys) may outlive a request; its caches are far larger.
    assert max(held) > baseline + 16_384
    assert await _settle(client) <= baseline + 1024
    assert client.engine.memory.reserved_bytes == 0 and client.engine.batch.cache is None


async def test_closing_the_stream_aborts(qwen_model, make_client) -> None:
    client = make_client(qwen_model, prefix_cache_bytes=0)
    stream = client.generate(_req("hello", 500))
    async for event in stream:
        if isinstance(event, TokenEvent):
            break
    await stream.aclose()
    await _settle(client)
    stats = client.stats()
    assert stats.active_requests == 0 and stats.requests_finished == 1
    assert stats.generated_tokens < 500


async def test_overlong_prompt_fails_before_any_compute(qwen_model, make_client) -> None:
    client = make_client(qwen_model, context_length=64)
    with pytest.raises(ContextOverflow, match="prompt is too long: 100 tokens"):
        await collect(client, _req("x" * 100, 5))
    assert await client.count_tokens(_req("x" * 100, 5)) == 100
    with pytest.raises(ContextOverflow):
        await collect(client, _req("x" * 64, 1))  # no room left for even one token
    assert client.stats().prompt_tokens_computed == 0
    ids, _ = await collect(client, _req("x" * 40, 24))  # exactly fills the window
    assert len(ids) == 24


async def test_max_tokens_beyond_the_window_is_clamped_to_the_room_left(qwen_model, make_client) -> None:
    client = make_client(qwen_model, context_length=64)
    ids, events = await collect(client, _req("x" * 40, 32000))  # Claude Code's fixed budget
    assert len(ids) == 24 and events[-1].finish_reason == "length"
    assert client.engine.memory.reserved_bytes == 0


async def test_max_tokens_beyond_memory_is_clamped_to_what_fits(qwen_model, make_client) -> None:
    probe = make_client(qwen_model, prefix_cache_bytes=0)
    room = probe.engine.memory.sequence_bytes(260) - probe.engine.memory.sequence_bytes(0)
    client = make_client(qwen_model, memory_limit_bytes=mx.get_active_memory() + room, prefix_cache_bytes=0)
    fits = client.engine.memory.tokens_that_fit()
    assert 200 < fits < 400
    ids, events = await collect(client, _req("x" * 200, 4000))
    assert len(ids) == fits - 200 and events[-1].finish_reason == "length"


async def test_request_that_can_never_fit_memory_is_refused(qwen_model, make_client) -> None:
    client = make_client(qwen_model, memory_limit_bytes=mx.get_active_memory() + 20_000)
    with pytest.raises(ContextOverflow, match="GiB is available"):
        await collect(client, _req("x" * 200, 200))
    assert client.stats().prompt_tokens_computed == 0


async def test_memory_short_now_waits_then_reports_busy(qwen_model, make_client) -> None:
    probe = make_client(qwen_model)
    one = probe.engine.memory.sequence_bytes(probe.engine.memory.reserve_tokens(5, 200, 4096))
    client = make_client(
        qwen_model,
        memory_limit_bytes=mx.get_active_memory() + int(one * 1.5),
        # the wait must end well before the first request's 200 tokens do (~0.25 s on a quiet
        # machine with the compiled decode step; a loaded one only makes it longer)
        queue_timeout_s=0.05,
        prefix_cache_bytes=0,
    )
    first = asyncio.create_task(collect(client, _req("first", 200)))
    while client.stats().active_requests == 0:  # "first" holds the memory before "other" asks
        await asyncio.sleep(0.005)
    _, events = await collect(client, _req("other", 200))
    assert isinstance(events[-1], ErrorEvent) and isinstance(events[-1].error, EngineBusy)
    ids, events = await first
    assert len(ids) == 200 and isinstance(events[-1], FinishEvent)


class GatedTokenizer(ByteTokenizer):
    """Holds every encode until `gate` is set: a long prompt still being rendered and tokenized."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()

    def encode(self, text: str) -> list[int]:
        self.entered.set()
        self.gate.wait(10)
        return super().encode(text)


async def test_abort_while_the_prompt_is_prepared_never_starts_it(qwen_model) -> None:
    tokenizer = GatedTokenizer()
    info = ModelInfo(id="tiny", family="test", context_length=4096, max_output_tokens=1024)
    client = InProcessEngine(qwen_model, tokenizer, info, eos_token_ids={EOS}, config=EngineConfig())
    try:
        request = _req("a prompt the client gives up on", 500)
        run = asyncio.create_task(collect(client, request))
        await asyncio.to_thread(tokenizer.entered.wait, 10)
        await client.abort(request.request_id)
        tokenizer.gate.set()
        ids, events = await run
        assert ids == [] and events[-1].finish_reason == "abort"
        assert client.stats().prompt_tokens_computed == 0 and client.stats().generated_tokens == 0
    finally:
        client.close()


def test_close_returns_once_the_engine_thread_has_let_go_of_the_engine(qwen_model) -> None:
    """A bench hands the device's memory to the servers it times right after its engine closes:
    by then the engine thread holds no reference, so dropping the client frees the engine."""
    import weakref

    info = ModelInfo(id="tiny", family="test", context_length=512, max_output_tokens=64)
    client = InProcessEngine(
        qwen_model, ByteTokenizer(), info, eos_token_ids={EOS}, config=EngineConfig(prefill_chunk=64)
    )
    engine = weakref.ref(client.engine)
    client.close()
    assert client.engine._let_go.is_set()
    client.close()  # a second close returns at once
    del client
    gc.collect()
    assert engine() is None


async def test_prompts_are_prepared_in_threads_that_close_joins(qwen_model, monkeypatch) -> None:
    """A worker of a shared pool drops its finished task, and the engine the task names, only when it
    is next scheduled: on a loaded machine, after the bench has read the device's memory. The engine's
    own preparing threads are joined by close, so the engine is freed as the client is dropped."""
    import weakref

    prepared_in = []
    make_sequence = InProcessEngine._make_sequence

    def recorded(self, request):
        prepared_in.append(threading.current_thread().name)
        return make_sequence(self, request)

    monkeypatch.setattr(InProcessEngine, "_make_sequence", recorded)
    info = ModelInfo(id="tiny", family="test", context_length=512, max_output_tokens=64)
    client = InProcessEngine(qwen_model, ByteTokenizer(), info, eos_token_ids={EOS})
    ids, _ = await collect(client, _req("hello", 3))
    assert len(ids) == 3 and prepared_in[0].startswith("kapitsa-prepare")
    engine = weakref.ref(client.engine)
    client.close()
    assert not [t for t in threading.enumerate() if t.name.startswith(f"{client._prepare_name}_")]
    _, events = await collect(client, _req("hello", 3))  # closed: answered, not raised
    assert isinstance(events[-1], ErrorEvent) and "stopped" in str(events[-1].error)
    del client, events  # an error event holds its traceback
    assert engine() is None  # no collection needed: nothing else holds it


async def test_requests_still_being_prepared_when_the_engine_closes_get_engine_dead(
    qwen_model, monkeypatch
) -> None:
    """Closing drops the preparations that have not started and waits for the running ones: every
    request, running or dropped, ends with an EngineDead event, none with a cancellation."""
    from kapitsa.engine import inprocess

    monkeypatch.setattr(inprocess, "PREPARE_THREADS", 1)
    tokenizer = GatedTokenizer()
    info = ModelInfo(id="tiny", family="test", context_length=512, max_output_tokens=64)
    client = InProcessEngine(qwen_model, tokenizer, info, eos_token_ids={EOS})
    running = asyncio.create_task(collect(client, _req("first", 3)))
    await asyncio.to_thread(tokenizer.entered.wait, 10)
    queued = asyncio.create_task(collect(client, _req("second", 3)))
    await asyncio.sleep(0.05)  # the second waits for the pool's one thread
    closing = asyncio.create_task(asyncio.to_thread(client.close))
    await asyncio.sleep(0.2)
    tokenizer.gate.set()
    await closing
    for task in (running, queued):
        ids, events = await asyncio.wait_for(task, 10)
        assert ids == [] and isinstance(events[-1], ErrorEvent) and "stopped" in str(events[-1].error)


async def test_an_engine_thread_ended_by_a_base_exception_still_lets_close_return(
    qwen_model, make_client, monkeypatch
) -> None:
    """SystemExit and the like pass the engine loop's own handler; its thread still lets go of the
    engine, so close returns at once rather than after its whole timeout."""
    from kapitsa.engine.runner.loop import Engine

    client = make_client(qwen_model)

    def exits(self):
        raise SystemExit("gone")

    monkeypatch.setattr(Engine, "_admit", exits)
    _, events = await asyncio.wait_for(collect(client, _req("hello", 4)), timeout=5)
    assert isinstance(events[-1], ErrorEvent) and "stopped" in str(events[-1].error)
    started = time.monotonic()
    client.engine.shutdown(timeout=10)
    assert time.monotonic() - started < 2 and client.engine._let_go.is_set()
