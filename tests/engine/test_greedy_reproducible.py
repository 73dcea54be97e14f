"""Greedy decoding is reproducible run to run: two fresh engines over freshly loaded tiny checkpoints
give the same tokens for one prompt, also when the second serves it next to other requests (MoE
routing, expert sums and batched decode must not depend on what else is in flight)."""

from __future__ import annotations

import asyncio

import pytest

from kapitsa.engine.inprocess import InProcessEngine
from kapitsa.engine.loading.loader import load_model
from kapitsa.engine.options import EngineConfig
from kapitsa.engine.types import GenerationRequest, SamplingParams, TokenEvent
from kapitsa.testing.tiny import write_tiny_checkpoint

NUM_TOKENS = 96
PROMPT = "def parse(lines):\n    out = []\n    for line in lines:\n"
OTHERS = ("Summarise the file in one line.", "import json\nprint(json.dumps({'a': [1, 2]}))")


async def _greedy(client: InProcessEngine, prompt: str) -> list[int]:
    sampling = SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True)
    request = GenerationRequest(prompt=prompt, sampling=sampling)
    return [t async for e in client.generate(request) if isinstance(e, TokenEvent) for t in e.token_ids]


def _fresh_engine(folder) -> InProcessEngine:
    config = EngineConfig(prefill_chunk=64, prefix_cache_bytes=0)
    return InProcessEngine.from_loaded(load_model(folder), config=config)


@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h"])
async def test_two_fresh_engines_decode_the_same_greedy_tokens(kind, tmp_path) -> None:
    folder = write_tiny_checkpoint(tmp_path / kind, kind)
    first = _fresh_engine(folder)
    alone = await _greedy(first, PROMPT)
    first.close()
    second = _fresh_engine(folder)
    try:
        again, *_ = await asyncio.gather(*(_greedy(second, p) for p in (PROMPT, *OTHERS)))
    finally:
        second.close()
    assert len(alone) == NUM_TOKENS
    assert again == alone
