"""The tiny Flint (sliding windows of 16 positions) through the engine: a cached turn equals a cold
one (memory and disk), speculative greedy equals plain with drafts and trees across the window
edge, and a batch equals its prompts alone."""

from __future__ import annotations

import asyncio

import mlx.core as mx
import pytest
from test_prefix_reuse import SYSTEM, chat, replay  # noqa: I001
from test_speculative_engine import PROMPTS, OracleDrafter, _alone_and_batched, _client, _references, _run

from kapitsa.engine.models import get_model_module
from kapitsa.engine.speculative.decoder import SpeculativeDecode
from kapitsa.engine.speculative.factory import make_decode_strategy
from kapitsa.testing.tiny_flint import flint_config, flint_weights


@pytest.fixture(scope="module")
def flint_model():
    cfg = flint_config()
    module = get_model_module("flint")
    model = module.Model(module.ModelArgs.from_dict(cfg))
    weights = {k: mx.array(v) for k, v in flint_weights(cfg).items()}
    model.load_weights(list(model.sanitize(weights).items()), strict=True)
    mx.eval(model.parameters())
    return model


async def test_cached_turns_equal_cold_ones(flint_model, make_client) -> None:
    cold = await replay(make_client(flint_model, prefix_cache_bytes=0), 3)
    warm = await replay(make_client(flint_model, prefill_chunk=24), 3)
    assert [ids for ids, _ in warm] == [ids for ids, _ in cold]
    assert all(u.cached_tokens > 16 for _, u in warm[1:])  # resumed past the window: the ring was restored


async def test_disk_checkpoint_equals_cold(flint_model, make_client, tmp_path) -> None:
    first = make_client(flint_model, disk_cache_dir=tmp_path, model_key="flint")
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
    text, _, _ = await chat(first, messages)
    first.close()
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "more"}]
    restarted = make_client(flint_model, disk_cache_dir=tmp_path, model_key="flint")
    _, ids, finish = await chat(restarted, messages)
    assert finish.usage.cached_tokens > len(SYSTEM)
    cold = (await chat(make_client(flint_model, prefix_cache_bytes=0), messages))[1]
    assert ids == cold


async def _plain(model) -> list[list[int]]:
    client = _client(model)
    try:
        return [(await _run(client, p))[0] for p in PROMPTS]
    finally:
        client.close()


async def test_greedy_speculation_equals_plain_alone_and_batched(flint_model) -> None:
    """Prompts of 15-51 tokens and 24 new ones: drafts of up to 5 cross position 16, 32, 48..."""
    plain = await _plain(flint_model)
    refs = _references(plain)
    strategies = [
        SpeculativeDecode(lambda: OracleDrafter(refs, seed=1), name="oracle", max_draft=5, adaptive=False),
        make_decode_strategy("ngram", draft_tokens=6),
    ]
    for strategy in strategies:
        alone, together = await _alone_and_batched(flint_model, strategy)
        assert alone == plain, strategy.name
        assert together == plain, strategy.name
    oracle = strategies[0].stats
    assert oracle.accepted > 0 and oracle.tokens_per_step > 1.2


async def test_draft_model_trees_equal_plain(flint_model) -> None:
    """The target drafts for itself in best-first trees: its cache checkpoints and restores the
    rings once per node, the verify commits one path of each tree."""
    plain = await _plain(flint_model)
    strategy = make_decode_strategy("draft", draft_model=flint_model, draft_tokens=4, tree=True)
    client = _client(flint_model, strategy)
    try:
        got = [(await _run(client, p))[0] for p in PROMPTS]
    finally:
        client.close()
    assert got == plain
    # the self-drafted path is accepted (a tree's siblings are not)
    assert strategy.stats.tokens_per_step > 1.5


async def test_batch_equals_alone(flint_model) -> None:
    plain = await _plain(flint_model)
    client = _client(flint_model)
    try:
        together = await asyncio.gather(*(_run(client, p) for p in PROMPTS))
    finally:
        client.close()
    assert [ids for ids, _, _ in together] == plain
