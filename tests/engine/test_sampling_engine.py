"""Sampling through the engine: seeds reproduce across batch neighbours, stop strings, logprobs."""

from __future__ import annotations

import asyncio

from engine_standins import ByteTokenizer  # noqa: I001

from kapitsa.engine.types import FinishEvent, GenerationRequest, SamplingParams, TokenEvent


async def run(client, request):
    ids, text, events = [], "", []
    async for event in client.generate(request):
        events.append(event)
        if isinstance(event, TokenEvent):
            ids.extend(event.token_ids)
            text += event.text
    return ids, text, events


def _sampled(prompt: str, seed: int | None, n: int = 16) -> GenerationRequest:
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=seed, max_tokens=n, ignore_eos=True)
    return GenerationRequest(prompt=prompt, sampling=params)


async def test_seeded_sampling_is_reproducible_alone_and_batched(family_model, make_client) -> None:
    client = make_client(family_model)
    alone = (await run(client, _sampled("tell me a story", 1234)))[0]
    again = (await run(client, _sampled("tell me a story", 1234)))[0]
    batched = await asyncio.gather(
        run(client, _sampled("a neighbour", 5)),
        run(client, _sampled("tell me a story", 1234)),
        run(client, _sampled("another neighbour " * 5, None)),
    )
    assert alone == again == batched[1][0]
    other_seed = (await run(client, _sampled("tell me a story", 4321)))[0]
    assert other_seed != alone


async def test_stop_string_spanning_tokens_ends_the_output(qwen_model, make_client) -> None:
    client = make_client(qwen_model)
    request = GenerationRequest(prompt="hi", sampling=SamplingParams(max_tokens=12, ignore_eos=True))
    ids, text, _ = await run(client, request)
    tok = ByteTokenizer()
    full = tok.decode(ids)
    printable = [i for i in range(1, len(full)) if full[i - 1 : i + 1].isprintable()]
    assert printable, "need two adjacent printable characters in the greedy output"
    cut = printable[len(printable) // 2]
    stop = full[cut - 1 : cut + 1]  # two characters: two byte tokens, so the match spans a boundary
    request = GenerationRequest(
        prompt="hi", sampling=SamplingParams(max_tokens=12, ignore_eos=True, stop=(stop,))
    )
    _, stopped_text, events = await run(client, request)
    finish = events[-1]
    assert isinstance(finish, FinishEvent) and finish.finish_reason == "stop" and finish.stop_sequence == stop
    assert stopped_text == full[: full.find(stop)]


async def test_stop_token_ids_and_logprobs(qwen_model, make_client) -> None:
    client = make_client(qwen_model)
    ids, _, _ = await run(
        client, GenerationRequest(prompt="hi", sampling=SamplingParams(max_tokens=6, ignore_eos=True))
    )
    request = GenerationRequest(
        prompt="hi",
        sampling=SamplingParams(max_tokens=6, stop_token_ids=(ids[2],), logprobs=2, ignore_eos=True),
    )
    got, _, events = await run(client, request)
    assert got == ids[: ids.index(ids[2]) + 1]
    assert events[-1].finish_reason == "stop"
    lps = [lp for e in events if isinstance(e, TokenEvent) for lp in e.logprobs]
    assert [lp.token_id for lp in lps] == got
    assert all(len(lp.top) == 2 and lp.top[0][0] == lp.token_id for lp in lps)  # greedy: the pick is the best
