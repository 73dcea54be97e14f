"""The quantized attention's query blocks (cache/quantized_kv.py): a prefill chunk split into blocks
of query positions gives the values of the whole chunk at once, and holds one block's scores."""

from __future__ import annotations

import mlx.core as mx
import pytest

from kapitsa.engine import options
from kapitsa.engine.cache.quantized_kv import quantized_attention

B, H, HKV, D, T, L = 2, 4, 2, 64, 96, 160


def _inputs(bits: int):
    mx.random.seed(3)
    q = mx.random.normal((B, H, T, D))
    keys = mx.quantize(mx.random.normal((B, HKV, L, D)), group_size=64, bits=bits)
    values = mx.quantize(mx.random.normal((B, HKV, L, D)), group_size=64, bits=bits)
    visible = mx.random.uniform(shape=(B, 1, T, L)) > 0.3  # a ragged batch's own mask
    mx.eval(q, *keys, *values, visible)
    return q, keys, values, visible


def _attend(q, keys, values, mask, bits):
    out = quantized_attention(q, keys, values, mask, scale=D**-0.5, group_size=64, bits=bits)
    mx.eval(out)
    return out


@pytest.mark.parametrize("bits", [8, 4])
def test_blocks_give_the_whole_chunks_values(bits: int, monkeypatch) -> None:
    q, keys, values, visible = _inputs(bits)
    whole = [_attend(q, keys, values, mask, bits) for mask in ("causal", visible)]
    monkeypatch.setattr(options, "SCORES_BLOCK_BYTES", B * H * L * 4 * 10)  # blocks of 10 rows, the last of 6
    blocks = [_attend(q, keys, values, mask, bits) for mask in ("causal", visible)]
    for got, want in zip(blocks, whole, strict=True):
        assert mx.allclose(got, want, atol=1e-6).item()


def test_blocks_hold_one_blocks_scores(monkeypatch) -> None:
    q, keys, values, _ = _inputs(8)

    def peak() -> int:
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        _attend(q, keys, values, "causal", 8)
        return mx.get_peak_memory() - base

    scores = B * H * T * L * 4
    whole = peak()
    monkeypatch.setattr(options, "SCORES_BLOCK_BYTES", scores // 8)
    assert whole >= scores  # the whole chunk's scores at once
    assert peak() < whole - scores // 2
