"""Ragged right-padded batches give every sequence what it gets alone; join/leave helpers."""

from __future__ import annotations

import mlx.core as mx
import pytest

from kapitsa.engine.cache.hybrid import HybridCache
from tests.models.builders import ARCHS, build_ours

PROMPTS = [[5, 9, 14, 3, 77, 120, 8], [200, 4, 4, 31], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
TOL = 1e-4


def _pad(prompts):
    T = max(map(len, prompts))
    return mx.array([p + [0] * (T - len(p)) for p in prompts]), [len(p) for p in prompts]


def _alone(model, prompt, steps):
    """Logits of the last prompt token, then of `steps` greedy decode steps, running alone."""
    cache = model.make_cache()
    rows = [model(mx.array([prompt]), cache)[0, -1]]
    for _ in range(steps):
        tok = int(mx.argmax(rows[-1]).item())
        rows.append(model(mx.array([[tok]]), cache)[0, -1])
    return rows, cache


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_prefill_and_decode_equal_single(arch):
    model = build_ours(arch)
    alone = [_alone(model, p, 4) for p in PROMPTS]
    cache = model.make_cache(len(PROMPTS))
    tokens, lengths = _pad(PROMPTS)
    out = model.forward(tokens, cache, lengths=lengths)
    assert cache.offsets == lengths
    rows = list(model.logits(model.last_hidden(out.hidden, lengths))[:, 0])
    for step in range(5):
        for b in range(len(PROMPTS)):
            assert mx.abs(rows[b] - alone[b][0][step]).max().item() < TOL, (arch, step, b)
        if step < 4:
            nxt = mx.array([[int(mx.argmax(r).item())] for r in rows])
            rows = list(model(nxt, cache)[:, -1])
    # the recurrent state of each row equals its solo run's state
    for b, (_, solo) in enumerate(alone):
        for mine, theirs in zip(cache.select([b]).layers, solo.layers, strict=True):
            if hasattr(mine, "state") and mine.state is not None:
                assert mx.abs(mine.state - theirs.state).max().item() < TOL
                assert mx.abs(mine.conv - theirs.conv).max().item() < TOL


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "nemotron_moe"])
def test_join_leave_extract_merge(arch):
    model = build_ours(arch)
    solo = []
    for p in PROMPTS:
        c = model.make_cache()
        model(mx.array([p]), c)
        solo.append(c)
    batch = HybridCache.merge(solo)  # three sequences of different lengths join
    assert batch.offsets == [len(p) for p in PROMPTS]
    batch.filter([2, 0])  # the middle one leaves
    late = model.make_cache()
    model(mx.array([[9, 9, 9]]), late)
    batch.extend(late)  # another joins
    assert batch.offsets == [len(PROMPTS[2]), len(PROMPTS[0]), 3]
    step = mx.array([[42], [42], [42]])
    got = model(step, batch)[:, -1]
    for row, c in enumerate([solo[2], solo[0], late]):
        want = model(mx.array([[42]]), c)[0, -1]
        assert mx.abs(got[row] - want).max().item() < TOL
    one = batch.extract(1)
    assert one.batch_size == 1 and one.offsets == [len(PROMPTS[0]) + 1]
    assert batch.nbytes > one.nbytes > 0 and batch.recurrent_nbytes > 0 and batch.kv_nbytes > 0


def test_merge_with_an_empty_sequence():
    model = build_ours("qwen3_5_dense")
    full = model.make_cache()
    model(mx.array([[5, 6, 7]]), full)
    batch = HybridCache.merge([full, model.make_cache()])
    got = model(mx.array([[1, 2, 3], [4, 0, 0]]), batch, lengths=[3, 1])
    fresh = model.make_cache()
    want = model(mx.array([[4]]), fresh)[0, -1]
    assert mx.abs(got[1, 0] - want).max().item() < TOL


def test_bad_lengths_are_rejected():
    model = build_ours("nemotron_dense")
    cache = model.make_cache(2)
    with pytest.raises(ValueError):
        model(mx.array([[1, 2], [3, 4]]), cache, lengths=[3, 1])
    with pytest.raises(ValueError):
        model(mx.array([[1, 2]]), cache)


def test_nemotron_right_padded_prefill_keeps_the_short_rows_ssm_state():
    """mlx-lm 0.32.2 zeroes it (hybrid-engine-proto/nh_pad.py); ours must equal the solo state."""
    model = build_ours("nemotron_dense")
    short, long = [3, 5, 7, 9, 11], [2, 4, 6, 8, 10, 12, 14, 16]
    batch = model.make_cache(2)
    model(mx.array([short + [0, 0, 0], long]), batch, lengths=[5, 8])
    solo = model.make_cache()
    model(mx.array([short]), solo)
    for mine, theirs in zip(batch.layers, solo.layers, strict=True):
        if mine is not None and hasattr(mine, "state"):
            assert mx.abs(theirs.state).max().item() > 1e-3
            assert mx.abs(mine.state[0] - theirs.state[0]).max().item() < 1e-5
            assert mx.abs(mine.conv[0] - theirs.conv[0]).max().item() < 1e-6


def test_idle_rows_are_left_untouched():
    """A row with lengths 0 takes no token: its state and offset stay as they were."""
    model = build_ours("qwen3_next")
    cache = model.make_cache(2)
    model(mx.array([[1, 2, 3], [4, 5, 6]]), cache)
    before = cache.select([1])
    model(mx.array([[7], [8]]), cache, lengths=[1, 0])
    assert cache.offsets == [4, 3]
    after = cache.select([1])
    got = model(mx.array([[9]]), after)[0, -1]
    want = model(mx.array([[9]]), before)[0, -1]
    assert mx.abs(got - want).max().item() < 1e-5


@pytest.mark.parametrize("arch", ["qwen3_5_dense", "nemotron_moe"])
def test_state_bytes_match_a_real_cache(arch):
    model = build_ours(arch)
    recurrent, kv_per_token = model.state_bytes(mx.float32)
    cache = model.make_cache()
    model(mx.array([[1, 2, 3]]), cache)
    assert cache.recurrent_nbytes == recurrent
    kv_layers = [c for c in cache.layers if c is not None and hasattr(c, "keys")]
    assert kv_per_token == sum(2 * c.keys[:, :, :1].nbytes for c in kv_layers)
