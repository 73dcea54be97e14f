"""A step that runs the device out of memory fails its requests as EngineBusy (a 503 a client retries),
hands MLX's buffer cache back, and the engine serves the next request; any other failure stays a
plain generation error."""

from __future__ import annotations

import asyncio
import logging
import weakref

import mlx.core as mx
import pytest

from kapitsa.engine.runner.memory import AloneFailures, DoesNotFit, failure_error
from kapitsa.engine.types import ErrorEvent, GenerationRequest, SamplingParams, TokenEvent
from kapitsa.errors import EngineBusy, InvalidRequest, KapitsaError

CUDA_OOM = "cudaMallocAsync(&data, size, stream) failed: out of memory"
METAL_OOM = "[METAL] Command buffer execution failed: Insufficient Memory (00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)"


def _request(max_tokens: int = 6) -> GenerationRequest:
    return GenerationRequest(
        prompt_token_ids=(5, 6, 7), sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    )


async def _tokens(client, max_tokens: int = 6) -> list[int]:
    """The request's tokens; its error event raised."""
    tokens = []
    async for event in client.generate(_request(max_tokens)):
        if isinstance(event, ErrorEvent):
            raise event.error
        if isinstance(event, TokenEvent):
            tokens += event.token_ids
    return tokens


def _fail_once(monkeypatch, runner, method: str, message: str, times: int = 1) -> list:
    """Make `runner.method` raise (its first `times` calls); the returned list gets a weak
    reference to the cache it was first called with (the failed step's state)."""
    real = getattr(runner, method)
    calls, failed_cache = {"n": 0}, []

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] <= times:
            failed_cache.append(weakref.ref(args[0]))
            raise RuntimeError(message)
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, method, failing)
    return failed_cache


@pytest.mark.parametrize("method", ["decode_lazy", "prefill_at"])
async def test_an_out_of_memory_step_is_engine_busy_and_the_engine_serves_on(
    qwen_model, make_client, monkeypatch, method
) -> None:
    client = make_client(qwen_model)
    expected = await _tokens(client)
    failed_cache = _fail_once(monkeypatch, client.engine.runner, method, CUDA_OOM)
    failed_state_alive = []

    def clear_cache() -> None:
        if failed_cache:  # the idle engine hands its cache back too: calls after the failure count
            failed_state_alive.append(failed_cache[0]() is not None)

    monkeypatch.setattr(mx, "clear_cache", clear_cache)
    # pytest's log capture keeps each record's traceback, and with it the failed step's frames
    monkeypatch.setattr(logging.getLogger("kapitsa.engine.runner.loop"), "propagate", False)
    with pytest.raises(EngineBusy, match="ran out of memory.*retry"):
        await _tokens(client)
    assert await _tokens(client) == expected  # served after the failed step's turn has ended
    # handed back once the failed step's state (its cache, its traceback's frames) was freed
    assert failed_state_alive and not any(failed_state_alive)
    assert client.stats().alive


async def test_another_step_failure_stays_a_generation_error(qwen_model, make_client, monkeypatch) -> None:
    client = make_client(qwen_model)
    _fail_once(monkeypatch, client.engine.runner, "decode_lazy", "some kernel bug")
    with pytest.raises(KapitsaError, match="generation failed: some kernel bug") as caught:
        await _tokens(client)
    assert not isinstance(caught.value, EngineBusy)
    assert len(await _tokens(client)) == 6


@pytest.mark.parametrize(
    "message",
    [
        CUDA_OOM,
        METAL_OOM,
        "[malloc] Unable to allocate 1073741824 bytes.",
        "CUDA_ERROR_OUT_OF_MEMORY",
        "cuBLAS error: CUBLAS_STATUS_ALLOC_FAILED",
        "Out of memory",
    ],
)
def test_each_backends_wording_is_out_of_memory(message) -> None:
    assert isinstance(failure_error(RuntimeError(message)), EngineBusy)


@pytest.mark.parametrize(
    "message", ["some kernel bug", "[metal::malloc] buffer larger than the maximum allowed"]
)
def test_other_failures_are_not_out_of_memory(message) -> None:
    error = failure_error(RuntimeError(message))
    assert not isinstance(error, EngineBusy) and "generation failed" in str(error)


def test_a_kapitsa_error_passes_through_unchanged() -> None:
    err = InvalidRequest("bad")
    assert failure_error(err) is err


async def test_a_request_alone_out_of_memory_twice_does_not_fit(qwen_model, make_client, monkeypatch) -> None:
    """The first failure alone may be other processes' memory (retry); the same request failing
    alone again is a 400 that says what to change; a smaller request still gets its retry."""
    client = make_client(qwen_model)
    _fail_once(monkeypatch, client.engine.runner, "prefill_at", CUDA_OOM, times=3)
    monkeypatch.setattr(logging.getLogger("kapitsa.engine.runner.loop"), "propagate", False)
    with pytest.raises(EngineBusy):
        await _tokens(client)
    with pytest.raises(DoesNotFit, match="twice with no other request running.*shorter prompt") as caught:
        await _tokens(client)
    assert caught.value.http_status == 400
    with pytest.raises(EngineBusy):  # fewer tokens than the one that failed: a retry may fit
        await _tokens(client, max_tokens=3)
    assert len(await _tokens(client, max_tokens=3)) == 3


async def test_requests_side_by_side_out_of_memory_stay_busy(qwen_model, make_client, monkeypatch) -> None:
    """A step that ran out of memory with another request running: alone, each may fit, so the
    failure is a 503 and leaves no record that a second one would turn into a 400."""
    client = make_client(qwen_model)
    await _tokens(client)
    _fail_once(monkeypatch, client.engine.runner, "decode_lazy", CUDA_OOM)
    monkeypatch.setattr(logging.getLogger("kapitsa.engine.runner.loop"), "propagate", False)
    results = await asyncio.gather(_tokens(client, 40), _tokens(client, 40), return_exceptions=True)
    assert any(isinstance(r, EngineBusy) for r in results), results
    assert not any(isinstance(r, Exception) and not isinstance(r, EngineBusy) for r in results), results
    assert client.engine.alone_failures.tokens is None


def test_a_finished_request_as_large_clears_the_record() -> None:
    failures, oom = AloneFailures(), RuntimeError(CUDA_OOM)
    assert isinstance(failures.error_for(oom, tokens=100, alone=True), EngineBusy)
    failures.note_finished(99)
    assert isinstance(failures.error_for(oom, tokens=100, alone=True), DoesNotFit)
    failures.note_finished(100)
    assert isinstance(failures.error_for(oom, tokens=120, alone=True), EngineBusy)
    assert isinstance(failures.error_for(oom, tokens=500, alone=False), EngineBusy)
