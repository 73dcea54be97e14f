"""A step that runs the device out of memory fails its requests as EngineBusy (a 503 a client retries),
hands MLX's buffer cache back, and the engine serves the next request; any other failure stays a
plain generation error."""

from __future__ import annotations

import asyncio
import logging
import weakref

import mlx.core as mx
import pytest

from kapitsa.engine.options import EngineConfig
from kapitsa.engine.runner.memory import AloneFailures, DoesNotFit, failure_error
from kapitsa.engine.types import ErrorEvent, GenerationRequest, SamplingParams, TokenEvent
from kapitsa.errors import EngineBusy, InvalidRequest, KapitsaError

CUDA_OOM = "cudaMallocAsync(&data, size, stream) failed: out of memory"
METAL_OOM = "[METAL] Command buffer execution failed: Insufficient Memory (00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)"


def _request(max_tokens: int = 6, prompt: tuple[int, ...] = (5, 6, 7)) -> GenerationRequest:
    return GenerationRequest(
        prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    )


async def _tokens(client, max_tokens: int = 6, prompt: tuple[int, ...] = (5, 6, 7)) -> list[int]:
    """The request's tokens; its error event raised."""
    tokens = []
    async for event in client.generate(_request(max_tokens, prompt)):
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
    """The first failure alone may be other processes' memory (retry); the same prompt failing
    alone again is a 400 that says what to change; another prompt still gets its retry, and the
    prompt finishing once clears its record."""
    client = make_client(qwen_model)
    _fail_once(monkeypatch, client.engine.runner, "prefill_at", CUDA_OOM, times=4)
    monkeypatch.setattr(logging.getLogger("kapitsa.engine.runner.loop"), "propagate", False)
    with pytest.raises(EngineBusy):
        await _tokens(client)
    with pytest.raises(DoesNotFit, match="twice with no other request running.*shorter prompt") as caught:
        await _tokens(client)
    assert caught.value.http_status == 400 and caught.value.prompt_tokens == 3
    assert caught.value.max_context < caught.value.prompt_tokens  # clients read it as the window's
    with pytest.raises(EngineBusy):  # another prompt: its first failure alone
        await _tokens(client, prompt=(8, 9, 10))
    with pytest.raises(EngineBusy):  # the prefill works again after 4 failures; this is the 4th
        await _tokens(client, prompt=(11, 12))
    assert len(await _tokens(client, prompt=(8, 9, 10))) == 6  # finished: its record goes
    assert client.engine.alone_failures.failed.keys() == {hash((5, 6, 7)), hash((11, 12))}


async def test_a_batch_and_a_prefill_out_of_memory_together(qwen_model, make_client, monkeypatch) -> None:
    """A decode batch and another request's prefill run out of memory in one step: the batch's rows
    go back to the queue and finish with the tokens they would have had (engine/runner/send_back.py),
    and so does the prefill's request, which did not run alone: it starts its prompt over."""
    client = make_client(qwen_model)
    expected = [await _tokens(client, 40, prompt=p) for p in [(5, 6, 7), (8, 9)]]
    third_expected = await _tokens(client, prompt=(11, 12, 13))
    engine, runner = client.engine, client.engine.runner
    real_decode, real_prefill = runner.decode_lazy, runner.prefill_at
    state = {"armed": False, "decode_failed": False}

    def decode_lazy(*args, **kwargs):
        if state["armed"] and engine.scheduler.prefilling and engine.scheduler.decoding:
            state["armed"], state["decode_failed"] = False, True
            raise RuntimeError(CUDA_OOM)
        return real_decode(*args, **kwargs)

    def prefill_at(*args, **kwargs):
        if state["decode_failed"]:
            state["decode_failed"] = False
            raise RuntimeError(CUDA_OOM)
        return real_prefill(*args, **kwargs)

    monkeypatch.setattr(runner, "decode_lazy", decode_lazy)
    monkeypatch.setattr(runner, "prefill_at", prefill_at)
    monkeypatch.setattr(logging.getLogger("kapitsa.engine.runner.loop"), "propagate", False)

    async def started(prompt: tuple[int, ...], begun: asyncio.Event):
        tokens = []
        async for event in client.generate(_request(40, prompt)):
            if isinstance(event, ErrorEvent):
                return event.error
            if isinstance(event, TokenEvent):
                tokens += event.token_ids
                begun.set()
        return tokens

    begun = [asyncio.Event(), asyncio.Event()]
    batch = [asyncio.create_task(started(p, e)) for p, e in zip([(5, 6, 7), (8, 9)], begun, strict=True)]
    await asyncio.gather(*(e.wait() for e in begun))
    state["armed"] = True
    halved = []
    real_halve = engine.batch_limit.after_failure
    monkeypatch.setattr(engine.batch_limit, "after_failure", lambda *a: halved.append(a[0]) or real_halve(*a))
    assert await _tokens(client, prompt=(11, 12, 13)) == third_expected
    assert await asyncio.gather(*batch) == expected
    assert engine.stats.failed == 0 and engine.stats.sent_back == 3 and not engine.alone_failures.failed
    assert halved == [3]  # one step failed: the limit halves once, from the three running


def test_a_record_expires_and_stays_bounded() -> None:
    failures, oom = AloneFailures(window_s=0.0, keep=2), RuntimeError(CUDA_OOM)
    assert isinstance(failures.error_for(oom, [1, 2], processed=0, alone=True), EngineBusy)
    assert isinstance(failures.error_for(oom, [1, 2], processed=0, alone=True), EngineBusy)  # expired
    failures.window_s = 60.0
    for prompt in ([1], [2], [3]):
        failures.error_for(oom, prompt, processed=0, alone=True)
    assert len(failures.failed) == 2 and hash((1,)) not in failures.failed
    assert isinstance(failures.error_for(oom, [3], processed=0, alone=False), EngineBusy)
    assert isinstance(
        failures.error_for(RuntimeError("kernel bug"), [3], processed=0, alone=True), KapitsaError
    )


async def test_an_out_of_memory_step_hands_the_prefix_cache_back(
    qwen_model, make_client, monkeypatch
) -> None:
    """The memory estimate let the request in next to the cached checkpoints; its retry gets theirs too."""
    client = make_client(qwen_model)
    prefix = client.engine.prefix
    await _tokens(client, prompt=tuple(range(5, 200)))
    assert await _soon(lambda: prefix.nbytes > 0)  # stored as the request ends, on the engine thread
    _fail_once(monkeypatch, client.engine.runner, "prefill_at", CUDA_OOM)
    monkeypatch.setattr(logging.getLogger("kapitsa.engine.runner.loop"), "propagate", False)
    with pytest.raises(EngineBusy):
        await _tokens(client, prompt=(300, 301, 302))
    assert await _soon(lambda: prefix.nbytes == 0)


async def _soon(condition, timeout_s: float = 5.0) -> bool:
    """Whether `condition()` holds within `timeout_s` (the engine thread acts after its events)."""
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return True
        await asyncio.sleep(0.01)
    return condition()


def test_a_prompt_that_keeps_failing_stays_refused_and_says_a_smaller_size() -> None:
    failures, oom = AloneFailures(window_s=60.0), RuntimeError(CUDA_OOM)
    failures.error_for(oom, [7], processed=0, alone=True)
    first = failures.failed[hash((7,))]
    refused = failures.error_for(oom, [7], processed=0, alone=True)
    assert isinstance(refused, DoesNotFit) and failures.failed[hash((7,))] >= first
    assert refused.max_context < refused.prompt_tokens
    failures.error_for(oom, [1, 2, 3], processed=0, alone=True)
    during_decode = failures.error_for(oom, [1, 2, 3], processed=9, alone=True)
    assert (during_decode.prompt_tokens, during_decode.max_context) == (3, 2)


def test_the_memory_limit_is_capped_by_mlxs_allocator(monkeypatch) -> None:
    """On CUDA MLX's allocator stops at 95% of the device: admission plans within that, not the
    device's whole size; a limit MLX does not report (0) leaves the device's size."""
    from kapitsa.engine.runner import memory

    monkeypatch.setattr(mx, "device_info", lambda: {"memory_size": 80 * 2**30})
    monkeypatch.setattr(mx, "get_memory_limit", lambda: 76 * 2**30)
    assert memory.device_memory_limit() == 76 * 2**30
    monkeypatch.setattr(mx, "get_memory_limit", lambda: 0)
    assert memory.device_memory_limit() == 80 * 2**30


def _cache_limit() -> int:
    """MLX's buffer-cache limit now (MLX reads it only by setting another)."""
    limit = mx.set_cache_limit(0)
    mx.set_cache_limit(limit)
    return limit


@pytest.fixture
def outer_cache_limit():
    outer = 7 * 2**30 + 12345
    before = mx.set_cache_limit(outer)
    yield outer
    mx.set_cache_limit(before)


def test_the_engine_bounds_mlxs_buffer_cache_and_gives_the_bound_back(
    qwen_model, make_client, outer_cache_limit
) -> None:
    """MLX would keep freed buffers up to its memory limit; the engine keeps an eighth of the limit
    (at least 1 GiB) or what its options say while it runs, and restores the process's bound when
    it closes."""
    from kapitsa.engine.runner import memory

    assert memory.buffer_cache_limit(80 * 2**30) == 10 * 2**30
    assert memory.buffer_cache_limit(4 * 2**30) == 2**30
    client = make_client(qwen_model, memory_limit_bytes=24 * 2**30)
    assert _cache_limit() == 3 * 2**30
    client.close()
    assert _cache_limit() == outer_cache_limit
    chosen = make_client(qwen_model, buffer_cache_bytes=5 * 2**20)
    assert _cache_limit() == 5 * 2**20
    chosen.close()
    assert _cache_limit() == outer_cache_limit


def test_engines_that_overlap_hold_the_smallest_bound_and_the_last_restores(
    qwen_model, make_client, outer_cache_limit
) -> None:
    a = make_client(qwen_model, buffer_cache_bytes=2**30)
    b = make_client(qwen_model, buffer_cache_bytes=2 * 2**30)
    assert _cache_limit() == 2**30
    a.close()  # not the last opened: b's bound stays
    assert _cache_limit() == 2 * 2**30
    a.engine._holds.release()  # a's engine thread letting go again after b took over
    assert _cache_limit() == 2 * 2**30
    b.close()
    assert _cache_limit() == outer_cache_limit


def test_an_engine_that_fails_to_open_leaves_the_bound_alone(
    qwen_model, make_client, outer_cache_limit, monkeypatch
) -> None:
    from kapitsa.engine.runner import loop

    def refuse(*args, **kwargs):
        raise RuntimeError("no warm-up today")

    monkeypatch.setattr(loop.BatchWarmup, "for_config", refuse)
    with pytest.raises(RuntimeError, match="no warm-up"):
        make_client(qwen_model)
    assert _cache_limit() == outer_cache_limit


def test_a_negative_buffer_cache_is_refused() -> None:
    with pytest.raises(ValueError, match="buffer_cache_bytes"):
        EngineConfig(buffer_cache_bytes=-1)


@pytest.fixture
def outer_switch_interval():
    import sys

    before = sys.getswitchinterval()
    sys.setswitchinterval(0.0042)
    yield 0.0042
    sys.setswitchinterval(before)


def test_engines_hold_the_gil_switch_interval_while_they_run(
    qwen_model, make_client, outer_switch_interval
) -> None:
    """A running engine shortens how long its thread waits for the GIL from a busy neighbour; the
    shortest of overlapping engines applies, and the process's own comes back after the last."""
    import sys

    a = make_client(qwen_model)  # the default: 1 ms
    assert sys.getswitchinterval() == pytest.approx(0.001)
    b = make_client(qwen_model, gil_switch_interval_s=0.0005)
    assert sys.getswitchinterval() == pytest.approx(0.0005)
    b.close()
    assert sys.getswitchinterval() == pytest.approx(0.001)
    a.close()
    assert sys.getswitchinterval() == pytest.approx(outer_switch_interval)
    left_alone = make_client(qwen_model, gil_switch_interval_s=None)
    assert sys.getswitchinterval() == pytest.approx(outer_switch_interval)
    left_alone.close()
    with pytest.raises(ValueError, match="gil_switch_interval_s"):
        EngineConfig(gil_switch_interval_s=0)
