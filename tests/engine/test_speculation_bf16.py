"""Greedy speculation writes what plain decoding writes in bf16 too, not only in float32: a verify
computes each position as a one-token decode step would (the same reductions), so near-ties
fall the same way. 256 tokens per prompt, both families, drafts accepted at every depth.

On a GPU (run this file on the H200: `pytest tests/engine/test_speculation_bf16.py`), the decode
and verify mat-vec kernels differ (ops/linear.py routes one row and up to 8 rows apart); this is
the check that they agree."""

from __future__ import annotations

import asyncio

import mlx.core as mx
import pytest
from engine_standins import ByteTokenizer, tiny_model  # noqa: I001
from test_speculative_engine import PROMPTS, OracleDrafter, _client, _run

from kapitsa.engine.speculative.decoder import SpeculativeDecode

N = 256


async def _outputs(model, strategy=None) -> list[list[int]]:  # noqa: ANN001
    client = _client(model, strategy)
    try:
        return [(await _run(client, p, n=N))[0] for p in PROMPTS[:2]]
    finally:
        client.close()


@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h"])
def test_bf16_greedy_speculation_equals_plain(kind: str) -> None:
    model = tiny_model(kind)
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    plain = asyncio.run(_outputs(model))
    refs = {tuple(ByteTokenizer().encode(p)): ids for p, ids in zip(PROMPTS, plain, strict=False)}
    strategy = SpeculativeDecode(
        lambda: OracleDrafter(refs, seed=3), name="oracle", max_draft=7, adaptive=False
    )
    assert asyncio.run(_outputs(model, strategy)) == plain
    stats = strategy.stats
    assert stats.accepted > N // 2 and stats.accepted < stats.proposed  # deep accepts and rejections
