"""n > 1: one prefill, then a forked decode per choice; each choice equals a request of its own."""

from __future__ import annotations

import asyncio
from collections import defaultdict

from kapitsa.engine.types import FinishEvent, GenerationRequest, SamplingParams, TokenEvent

PROMPT = "the quick brown fox jumps over the lazy dog " * 3


async def choices(client, request: GenerationRequest) -> tuple[dict[int, list[int]], dict[int, FinishEvent]]:
    ids: dict[int, list[int]] = defaultdict(list)
    finishes: dict[int, FinishEvent] = {}
    async for event in client.generate(request):
        if isinstance(event, TokenEvent):
            ids[event.index].extend(event.token_ids)
        elif isinstance(event, FinishEvent):
            finishes[event.index] = event
    return dict(ids), finishes


def sampled(seed: int | None, *, n: int = 1, max_tokens: int = 12) -> GenerationRequest:
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=seed, max_tokens=max_tokens, ignore_eos=True)
    return GenerationRequest(prompt=PROMPT, sampling=params, n=n)


async def test_each_choice_equals_its_own_request_and_the_prefill_runs_once(
    family_model, make_client
) -> None:
    client = make_client(family_model, prefix_cache_bytes=0)  # no cache: every prompt token is computed
    before = client.stats().prompt_tokens_computed
    ids, finishes = await choices(client, sampled(40, n=3))
    computed = client.stats().prompt_tokens_computed - before
    prompt_tokens = finishes[0].usage.prompt_tokens
    assert computed == prompt_tokens  # one prefill for three choices
    assert sorted(finishes) == [0, 1, 2] and all(f.usage.completion_tokens == 12 for f in finishes.values())
    alone = [(await choices(client, sampled(40 + i)))[0][0] for i in range(3)]
    assert [ids[i] for i in range(3)] == alone  # choice i samples as seed + i alone would
    assert len({tuple(a) for a in alone}) == 3


async def test_greedy_choices_are_identical(qwen_model, make_client) -> None:
    client = make_client(qwen_model)
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    ids, _ = await choices(client, GenerationRequest(prompt=PROMPT, sampling=greedy, n=4))
    single, _ = await choices(client, GenerationRequest(prompt=PROMPT + "!", sampling=greedy))
    again, _ = await choices(client, GenerationRequest(prompt=PROMPT, sampling=greedy))
    assert ids[0] == ids[1] == ids[2] == ids[3] == again[0] != single[0]


async def test_abort_ends_every_choice(qwen_model, make_client) -> None:
    client = make_client(qwen_model)
    request = sampled(None, n=3, max_tokens=1000)
    finishes: list[FinishEvent] = []

    async def consume() -> None:
        async for event in client.generate(request):
            if isinstance(event, TokenEvent) and event.index == 2:
                await client.abort(request.request_id)
            if isinstance(event, FinishEvent):
                finishes.append(event)

    await asyncio.wait_for(consume(), 60)
    assert sorted(f.index for f in finishes) == [0, 1, 2]
    assert {f.finish_reason for f in finishes} == {"abort"}
    for _ in range(200):  # the engine leaves the batch just after it reports the finish
        if client.stats().active_requests == 0:
            break
        await asyncio.sleep(0.01)
    assert client.stats().active_requests == 0
    assert client.engine.memory.reserved_bytes == 0  # every choice's share is given back
