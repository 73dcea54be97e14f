"""A prefix-cache restore sizes the K/V buffers for the prompt's remaining tokens (issue #29): the
edges' K/V is written once, and the forwards that follow write into the buffers rather than grow
them (a grow is a second copy of all K/V), float and quantized K/V alike."""

from __future__ import annotations

import mlx.core as mx
import pytest
from engine_standins import tiny_model

from kapitsa.engine.cache.layers import KV_STEP
from kapitsa.engine.cache.prefix import PrefixCache
from kapitsa.engine.runner.model_runner import ModelRunner

TOKENS = [(7 * i) % 200 + 5 for i in range(300)]


def _capacities(runner: ModelRunner, cache) -> set[int]:  # noqa: ANN001
    return {a.shape[2] for i in runner.kv_layers for a in cache.layers[i].slots()}


@pytest.mark.parametrize("bits", [None, 8])
def test_restore_leaves_room_so_the_next_forwards_do_not_copy_the_kv(bits: int | None) -> None:
    runner = ModelRunner(tiny_model("qwen3_5"), kv_bits=bits)
    assert runner.kv_layers
    live, prefix = runner.new_cache(), PrefixCache(budget_bytes=1 << 30)
    for end in (100, 230):  # two checkpoints: the match joins two edges
        runner.prefill(live, TOKENS[live.offsets[0] : end])
        prefix.insert(
            TOKENS[:end],
            recurrent=runner.recurrent_state(live),
            kv_source=lambda a, b: runner.kv_span(live, a, b),
        )
    match = prefix.lookup(TOKENS)
    assert match.pos == 230 and all(len(spans) == 2 for spans in match.kv_spans)

    exact = runner.restore(match)  # no room asked: exactly the restored tokens, as before
    assert _capacities(runner, exact) == {230}

    restored = runner.restore(match, room=70)
    # 300 tokens rounded up to the growth step: the layout of a cache grown from empty
    assert _capacities(runner, restored) == {2 * KV_STEP} and restored.offsets == [230]
    for i in runner.kv_layers:
        for got, want in zip(restored.layers[i].slots(), live.layers[i].slots(), strict=True):
            assert mx.array_equal(got[:, :, :230], want[:, :, :230]).item()
            assert not mx.any(got[:, :, 230:]).item()  # scratch past the offset, as `_reserve` pads

    for start, end in ((230, 260), (260, 300)):
        got = runner.prefill(restored, TOKENS[start:end])
        want = runner.prefill(live, TOKENS[start:end])
        assert mx.allclose(got, want, atol=1e-5).item()
        # `_reserve` finds room: the forward writes into restore's buffers, no new one is made
        assert _capacities(runner, restored) == {2 * KV_STEP}
    assert restored.offsets == [300]
