from __future__ import annotations

from kapitsa.engine.types import FinishEvent, GenerationRequest, SamplingParams, TokenEvent


async def _run(client, request):
    events = [e async for e in client.generate(request)]
    ids = [t for e in events if isinstance(e, TokenEvent) for t in e.token_ids]
    return ids, events


async def test_generates_and_finishes(qwen_model, make_client) -> None:
    client = make_client(qwen_model)
    ids, events = await _run(
        client, GenerationRequest(prompt="hello world", sampling=SamplingParams(max_tokens=8))
    )
    assert len(ids) == 8
    assert isinstance(events[-1], FinishEvent) and events[-1].finish_reason == "length"
    assert events[-1].usage.prompt_tokens == 11
