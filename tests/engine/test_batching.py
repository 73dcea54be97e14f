"""Continuous batching: a sequence's greedy output does not depend on its batch neighbours."""

from __future__ import annotations

import asyncio

import pytest

from kapitsa.engine.types import (
    FinishEvent,
    GenerationRequest,
    PrefillProgressEvent,
    SamplingParams,
    TokenEvent,
)

PROMPTS = [
    "hi",
    "The quick brown fox jumps over the lazy dog. " * 2,
    "def add(x, y):\n    return x + y\n" * 8,
    "A longer prompt that needs several prefill chunks. " * 6,
]


async def collect(client, request):
    ids, events = [], []
    async for event in client.generate(request):
        events.append(event)
        if isinstance(event, TokenEvent):
            ids.extend(event.token_ids)
    return ids, events


def _request(prompt: str, max_tokens: int) -> GenerationRequest:
    return GenerationRequest(prompt=prompt, sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))


async def test_batched_equals_single_stream(family_model, make_client) -> None:
    client = make_client(family_model, prefill_chunk=64, prefix_cache_bytes=0)
    lengths = [10, 6, 14, 8]  # different lengths: sequences leave the batch at different steps
    alone = [(await collect(client, _request(p, n)))[0] for p, n in zip(PROMPTS, lengths, strict=True)]
    together = await asyncio.gather(
        *(collect(client, _request(p, n)) for p, n in zip(PROMPTS, lengths, strict=True))
    )
    assert [ids for ids, _ in together] == alone
    assert [len(ids) for ids in alone] == lengths
    long_events = together[3][1]
    progress = [e.processed_tokens for e in long_events if isinstance(e, PrefillProgressEvent)]
    assert progress[0] == 0 and len(progress) > 1  # the start report, then chunks
    assert all(isinstance(events[-1], FinishEvent) for _, events in together)


async def test_requests_join_a_running_batch(qwen_model, make_client) -> None:
    client = make_client(qwen_model, prefill_chunk=32, prefix_cache_bytes=0)
    alone = [(await collect(client, _request(p, 12)))[0] for p in PROMPTS[:3]]
    first = asyncio.create_task(collect(client, _request(PROMPTS[0], 12)))
    await asyncio.sleep(0.05)  # the first is decoding when the others arrive
    rest = await asyncio.gather(*(collect(client, _request(p, 12)) for p in PROMPTS[1:3]))
    assert [(await first)[0], *(ids for ids, _ in rest)] == alone
    assert client.stats().requests_finished == 6


async def test_pipelined_and_synchronous_sequences_mix(qwen_model, make_client) -> None:
    """Greedy rows decode pipelined; a penalty/logprobs row forces synchronous steps; same outputs."""
    client = make_client(qwen_model, prefix_cache_bytes=0)
    plain = _request(PROMPTS[1], 14)
    penalised = GenerationRequest(
        prompt=PROMPTS[2],
        sampling=SamplingParams(max_tokens=10, frequency_penalty=0.5, logprobs=1, ignore_eos=True),
    )
    alone = [(await collect(client, r))[0] for r in (plain, penalised)]
    first = asyncio.create_task(collect(client, plain))
    await asyncio.sleep(0.05)  # the greedy one is decoding (pipelined) when the other joins
    second = await collect(client, penalised)
    assert [(await first)[0], second[0]] == alone


async def test_custom_decode_strategy_is_used(qwen_model, make_client) -> None:
    from kapitsa.engine.runner.decode import PlainDecode

    class Counting(PlainDecode):
        name = "counting"
        pipelined = False
        calls = 0

        def step(self, runner, cache, sequences):
            Counting.calls += 1
            return super().step(runner, cache, sequences)

    plain = make_client(qwen_model, prefix_cache_bytes=0)
    expected = [(await collect(plain, _request(p, 6)))[0] for p in PROMPTS[:2]]
    client = make_client(qwen_model, prefix_cache_bytes=0)
    client.engine.decode_strategy = Counting()
    got = await asyncio.gather(*(collect(client, _request(p, 6)) for p in PROMPTS[:2]))
    assert [ids for ids, _ in got] == expected
    assert Counting.calls >= 5 and client.stats().speculative == "counting"


async def test_an_eos_decayed_answer_decodes_pipelined_and_ends_where_synchronous_steps_end(
    qwen_model, make_client
) -> None:
    """The checkpoint's EOS decay (`exponential_decay_length_penalty`) reads only how many tokens came
    before a pick, so it stays pipelined; a logprobs request runs the same picks synchronously."""
    client = make_client(qwen_model, prefix_cache_bytes=0)

    def request(**extra) -> GenerationRequest:
        return GenerationRequest(
            prompt=PROMPTS[1], sampling=SamplingParams(max_tokens=64, eos_decay=(2, 3.0), **extra)
        )

    batch, steps = client.engine.batch, []
    queue_step = batch.pipelined_step
    batch.pipelined_step = lambda *args: steps.append(1) or queue_step(*args)
    pipelined, events = await collect(client, request())
    assert len(steps) >= len(pipelined) - 1
    steps.clear()
    synchronous, _ = await collect(client, request(logprobs=0))
    assert not steps and pipelined == synchronous
    finish = next(e for e in events if isinstance(e, FinishEvent))
    assert finish.finish_reason == "stop" and len(pipelined) < 64  # the decay ended the answer


@pytest.mark.parametrize(
    "penalties",
    [
        dict(repetition_penalty=1.5),
        dict(presence_penalty=1.5, frequency_penalty=0.8),
        dict(frequency_penalty=2.0),
    ],
)
async def test_penalised_answers_decode_pipelined_and_equal_synchronous_steps(
    qwen_model, make_client, penalties
) -> None:
    """Penalties count the output on the device, a queued pick included: they stay pipelined, and
    the same picks taken synchronously (a logprobs request) give the same tokens."""
    client = make_client(qwen_model, prefix_cache_bytes=0)

    def request(**extra) -> GenerationRequest:
        sampling = SamplingParams(max_tokens=24, ignore_eos=True, **penalties, **extra)
        return GenerationRequest(prompt=PROMPTS[2], sampling=sampling)

    batch, steps = client.engine.batch, []
    queue_step = batch.pipelined_step
    batch.pipelined_step = lambda *args: steps.append(1) or queue_step(*args)
    pipelined, _ = await collect(client, request())
    assert len(steps) >= 20
    steps.clear()
    synchronous, _ = await collect(client, request(logprobs=0))
    assert not steps and pipelined == synchronous
    plain, _ = await collect(
        client, GenerationRequest(prompt=PROMPTS[2], sampling=SamplingParams(max_tokens=24, ignore_eos=True))
    )
    assert pipelined != plain  # the penalties changed the answer
