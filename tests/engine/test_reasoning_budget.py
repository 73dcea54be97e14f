"""A reasoning budget in the engine: once the output has that many tokens and has not closed its
reasoning, the next token is the closing one, and decoding goes on from there as if the model had
written it, in plain decoding (pipelined), in a batch and under speculative decoding alike."""

from __future__ import annotations

import asyncio

import pytest
from engine_standins import EOS, ByteTokenizer, tiny_model  # noqa: I001

from kapitsa.engine.inprocess import InProcessEngine
from kapitsa.engine.options import EngineConfig
from kapitsa.engine.speculative.factory import make_decode_strategy
from kapitsa.engine.types import GenerationRequest, ModelInfo, SamplingParams, TokenEvent

PROMPTS = ["def add(x, y):\n    return x + y\n\ndef add(x, y):\n", "abc abc abc abc"]
N_TOKENS, BUDGET = 20, 5


def _client(model, decode=None) -> InProcessEngine:
    info = ModelInfo(id="tiny", family="test", context_length=4096, max_output_tokens=1024)
    config = EngineConfig(prefill_chunk=64, prefix_cache_bytes=0)
    return InProcessEngine(model, ByteTokenizer(), info, eos_token_ids={EOS}, config=config, decode=decode)


async def _ids(client, prompt_ids: list[int], n: int, budget: tuple[int, int] | None = None) -> list[int]:
    params = SamplingParams(max_tokens=n, ignore_eos=True, reasoning_budget=budget)
    out: list[int] = []
    async for event in client.generate(
        GenerationRequest(prompt_token_ids=tuple(prompt_ids), sampling=params)
    ):
        if isinstance(event, TokenEvent):
            out += event.token_ids
    return out


@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h"])
async def test_the_budget_closes_reasoning_in_every_decode_path(kind: str) -> None:
    model = tiny_model(kind)
    tok = ByteTokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    plain = _client(model)
    try:
        free = [await _ids(plain, p, N_TOKENS) for p in prompts]
        # a closing token the model does not write in its first BUDGET tokens
        closes = [next(t for t in range(300, 200, -1) if t not in out[:BUDGET]) for out in free]
        expected = []
        for prompt, out, close in zip(prompts, free, closes, strict=True):
            head = [*out[:BUDGET], close]
            expected.append(head + await _ids(plain, prompt + head, N_TOKENS - len(head)))
    finally:
        plain.close()
    for strategy in (None, make_decode_strategy("ngram", draft_tokens=6)):
        client = _client(model, strategy)
        try:
            alone = [
                await _ids(client, p, N_TOKENS, (BUDGET, c)) for p, c in zip(prompts, closes, strict=True)
            ]
            together = await asyncio.gather(
                *(_ids(client, p, N_TOKENS, (BUDGET, c)) for p, c in zip(prompts, closes, strict=True))
            )
        finally:
            client.close()
        name = strategy.name if strategy else "plain"
        assert alone == expected, name
        assert list(together) == expected, name


async def test_reasoning_closed_before_the_budget_is_left_alone() -> None:
    model = tiny_model("qwen3_5")
    prompt = ByteTokenizer().encode(PROMPTS[0])
    client = _client(model)
    try:
        free = await _ids(client, prompt, N_TOKENS)
        # the model's own third token counts as the close: nothing is forced after it
        assert await _ids(client, prompt, N_TOKENS, (BUDGET, free[2])) == free
    finally:
        client.close()
