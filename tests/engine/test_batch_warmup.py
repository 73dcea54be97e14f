"""The idle engine warms its decode batch sizes (runner/warmup.py): a later burst of those sizes
traces nothing new, writes what an unwarmed engine writes, and the warm-up never blocks, fails or
overfills the engine."""

from __future__ import annotations

import asyncio

import mlx.core as mx
import pytest
from engine_standins import tiny_model

from kapitsa.engine.options import EngineConfig
from kapitsa.engine.runner import warmup
from kapitsa.engine.runner.warmup import default_warm_batches
from kapitsa.engine.types import GenerationRequest, SamplingParams, TokenEvent

FAMILIES = ("qwen3_5", "nemotron_h")
# longer than the compiled short-chain limit (models/base.py CHAIN_MAX_T): prefill runs op by op
PROMPTS = [f"stream {i} asks a question long enough to pass sixteen tokens" for i in range(4)]


def _count_traces(monkeypatch) -> list[int]:
    """Counts every trace of a function `mx.compile` wraps from now on (a call served from MLX's
    trace cache does not run the Python function)."""
    traced = [0]
    real = mx.compile

    def counting(fn, *args, **kwargs):
        def traced_fn(*a):
            traced[0] += 1
            return fn(*a)

        return real(traced_fn, *args, **kwargs)

    monkeypatch.setattr(mx, "compile", counting)
    return traced


async def _until_warm(client) -> None:
    for _ in range(1000):
        if client.stats().warm_batches_pending == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the warm-up did not finish")


async def _burst(client) -> list[list[int]]:
    async def one(prompt: str) -> list[int]:
        request = GenerationRequest(prompt=prompt, sampling=SamplingParams(max_tokens=6, ignore_eos=True))
        ids: list[int] = []
        async for event in client.generate(request):
            if isinstance(event, TokenEvent):
                ids.extend(event.token_ids)
        return ids

    return list(await asyncio.gather(*(one(p) for p in PROMPTS)))


@pytest.mark.parametrize("kind", FAMILIES)
async def test_a_warmed_burst_traces_nothing_new(kind, make_client, monkeypatch) -> None:
    traced = _count_traces(monkeypatch)
    cold = make_client(tiny_model(kind), max_running=4, warm_batches=())
    await _until_warm(cold)
    before = traced[0]
    cold_ids = await _burst(cold)
    assert traced[0] > before  # the control: an unwarmed engine traces its batch sizes in the burst

    warm = make_client(tiny_model(kind), max_running=4, warm_batches=(1, 2, 3, 4))
    await _until_warm(warm)
    assert warm.stats().warmup_seconds > 0
    before = traced[0]
    assert await _burst(warm) == cold_ids
    assert traced[0] == before


async def test_a_request_during_the_warm_up_is_served(qwen_model, make_client) -> None:
    client = make_client(qwen_model, max_running=8, warm_batches=tuple(range(1, 9)))
    request = GenerationRequest(prompt=PROMPTS[0], sampling=SamplingParams(max_tokens=4, ignore_eos=True))
    events = [event async for event in client.generate(request)]
    assert sum(len(e.token_ids) for e in events if isinstance(e, TokenEvent)) == 4
    await _until_warm(client)


async def test_a_failing_warm_up_is_skipped_and_the_engine_serves(
    qwen_model, make_client, monkeypatch
) -> None:
    def broken(runner, rows):
        raise RuntimeError("no kernel for this size")

    monkeypatch.setattr(warmup, "warm_decode_step", broken)
    client = make_client(qwen_model, max_running=4, warm_batches=(1, 2, 3, 4))
    await _until_warm(client)
    assert client.stats().warmup_seconds == 0 and client.engine.alive
    ids = await _burst(client)
    assert all(len(i) == 6 for i in ids)


async def test_sizes_whose_state_does_not_fit_are_not_warmed(qwen_model, make_client, monkeypatch) -> None:
    warmed: list[int] = []
    monkeypatch.setattr(warmup, "warm_decode_step", lambda runner, rows: warmed.append(rows))
    client = make_client(qwen_model, max_running=8, warm_batches=(1, 2, 8))
    budget = client.engine.memory
    room = budget.available_bytes - budget.reserved_bytes
    await _until_warm(client)
    assert warmed == [1, 2, 8]  # the control: all fit
    per_row = budget.sequence_bytes(warmup.KV_STEP)
    tight = warmup.BatchWarmup((1, 2, 8), budget, prefix=None)
    budget.reserve(room - 2 * per_row)  # room for two rows only
    try:
        warmed.clear()
        while tight.run_one(client.engine.runner):
            pass
    finally:
        budget.release(room - 2 * per_row)
    assert warmed == [1, 2]


def test_default_sizes_are_every_batch_on_a_gpu_and_none_on_the_cpu() -> None:
    assert default_warm_batches(8, on_gpu=True) == (1, 2, 3, 4, 5, 6, 7, 8)
    assert default_warm_batches(8, on_gpu=False) == ()
    assert EngineConfig().warm_batches == ()  # none unless asked: a one-user engine forms no batches


@pytest.mark.parametrize("sizes", [(0,), (9,), (1, 16)])
def test_warm_sizes_outside_the_batch_are_refused(sizes) -> None:
    with pytest.raises(ValueError, match="warm_batches"):
        EngineConfig(max_running=8, warm_batches=sizes)
