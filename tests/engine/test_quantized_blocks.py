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


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("length", [L, 1, 13])  # lengths MLX's CUDA quantized matmul refuses
def test_dequantize_first_matches_the_quantized_matmuls(bits: int, length: int, monkeypatch) -> None:
    """The route CUDA takes (K/V dequantized once, plain matmuls) gives the quantized matmuls'
    values, with a causal and a ragged mask, whole and in query blocks."""
    q, keys, values, visible = _inputs(bits)
    keys = tuple(a[:, :, :length] for a in keys)
    values = tuple(a[:, :, :length] for a in values)
    q = q[:, :, -min(T, length) :]  # every causal row sees a key
    first_key = mx.arange(length) == 0  # and every ragged row one
    masks = ("causal", visible[:, :, -q.shape[2] :, :length] | first_key)
    for blocked in (False, True):
        if blocked:
            monkeypatch.setattr(options, "SCORES_BLOCK_BYTES", B * H * length * 4 * 7)
        for mask in masks:
            kwargs = dict(scale=D**-0.5, group_size=64, bits=bits)
            if mx.default_device().type == mx.cpu:
                want = quantized_attention(q, keys, values, mask, dequantize_first=False, **kwargs)
            else:  # the GPU's reference: the float attention over the dequantized values
                want = _float_attention(q, keys, values, mask, bits)
            got = quantized_attention(q, keys, values, mask, dequantize_first=True, **kwargs)
            assert mx.allclose(got, want, atol=1e-5).item()


def _float_attention(q, keys, values, mask, bits):
    k, v = (mx.dequantize(*kv, group_size=64, bits=bits) for kv in (keys, values))
    k, v = (mx.repeat(a, H // HKV, axis=1) for a in (k, v))
    scores = (q * D**-0.5) @ k.swapaxes(-1, -2)
    T_, L_ = scores.shape[-2:]
    if isinstance(mask, str):
        mask = mx.arange(L_ - T_, L_)[:, None] >= mx.arange(L_)[None]
    scores = mx.where(mask, scores, -mx.inf)
    return mx.softmax(scores, axis=-1) @ v


def test_float_reference_matches_the_quantized_matmuls() -> None:
    """The GPU case's reference agrees with the quantized matmuls where they run (here)."""
    q, keys, values, visible = _inputs(8)
    for mask in ("causal", visible):
        want = quantized_attention(
            q, keys, values, mask, scale=D**-0.5, group_size=64, bits=8, dequantize_first=False
        )
        assert mx.allclose(_float_attention(q, keys, values, mask, 8), want, atol=1e-5).item()
