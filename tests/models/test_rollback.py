"""Rollback by replay (speculative decoding) and checkpoint/restore."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest

from kapitsa.engine.cache.layers import RecurrentCache
from tests.models.builders import ARCHS, build_ours

PROMPT = [11, 23, 5, 99, 140, 7, 64, 3]
DRAFT = [42, 17, 250, 8, 8, 130]
AFTER = [[77], [5], [190]]


def _continue(model, cache):
    return [model(mx.array([t]), cache)[0, -1] for t in AFTER]


def _diff(xs, ys):
    return max(mx.abs(x - y).max().item() for x, y in zip(xs, ys, strict=True))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("drop", [0, 1, 4, 6])
def test_rollback_equals_never_decoding(arch, drop):
    model = build_ours(arch)
    spec = model.make_cache()
    model(mx.array([PROMPT]), spec)
    model(mx.array([DRAFT]), spec, record=True)
    spec.rollback(drop)
    plain = model.make_cache()
    model(mx.array([PROMPT + DRAFT[: len(DRAFT) - drop]]), plain)
    assert spec.offsets == plain.offsets
    assert _diff(_continue(model, spec), _continue(model, plain)) < 1e-4


@pytest.mark.parametrize("arch", ["qwen3_5_dense", "nemotron_dense"])
def test_negative_control_skipping_replay_diverges(arch):
    """Lowering the offsets without replaying the recurrent layers must be caught."""
    model = build_ours(arch)
    naive = model.make_cache()
    model(mx.array([PROMPT]), naive)
    model(mx.array([DRAFT]), naive, record=True)
    naive.offsets = [o - 4 for o in naive.offsets]  # what a KV-only trim would do
    naive.commit()
    plain = model.make_cache()
    model(mx.array([PROMPT + DRAFT[:2]]), plain)
    assert _diff(_continue(model, naive), _continue(model, plain)) > 1e-3


@pytest.mark.parametrize("arch", ["qwen3_next", "nemotron_moe"])
def test_batched_rollback_per_sequence(arch):
    model = build_ours(arch)
    prompts = [PROMPT, PROMPT[:3]]
    cache = model.make_cache(2)
    T = len(PROMPT)
    model(mx.array([p + [0] * (T - len(p)) for p in prompts]), cache, lengths=[T, 3])
    drafts = mx.array([DRAFT[:5], DRAFT[1:6]])
    model(drafts, cache, record=True)
    cache.rollback([1, 4])
    kept = [DRAFT[:4], DRAFT[1:2]]
    step = model(mx.array([[77], [77]]), cache)[:, -1]
    for b in range(2):
        solo = model.make_cache()
        model(mx.array([prompts[b] + kept[b]]), solo)
        want = model(mx.array([[77]]), solo)[0, -1]
        assert mx.abs(step[b] - want).max().item() < 1e-4


def test_rollback_needs_a_recorded_forward():
    model = build_ours("qwen3_5_dense")
    cache = model.make_cache()
    model(mx.array([PROMPT]), cache)
    with pytest.raises(ValueError):
        cache.rollback(2)
    cache.rollback(0)  # dropping nothing is always fine


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "nemotron_latent"])
def test_greedy_speculative_loop_equals_plain_greedy(arch):
    """A noisy drafter (right prefix of random length, then junk) exercises every accept count."""
    model = build_ours(arch)
    rng = random.Random(0)
    cache = model.make_cache()
    ref, logits = [], model(mx.array([PROMPT]), cache)[0, -1]
    for _ in range(30):
        ref.append(int(mx.argmax(logits).item()))
        logits = model(mx.array([[ref[-1]]]), cache)[0, -1]
    cache = model.make_cache()
    out = [int(mx.argmax(model(mx.array([PROMPT]), cache)[0, -1]).item())]
    while len(out) < 30:
        good = rng.randint(0, 4)
        draft = [
            ref[len(out) + i] if i < good and len(out) + i < 30 else rng.randrange(256) for i in range(4)
        ]
        target = mx.argmax(model(mx.array([[out[-1]] + draft]), cache, record=True)[0], axis=-1).tolist()
        n = 0
        while n < 4 and draft[n] == target[n]:
            n += 1
        out += draft[:n] + [target[n]]
        cache.rollback(4 - n)
    assert out[:30] == ref


@pytest.mark.parametrize("arch", ["qwen3_5_dense", "nemotron_moe"])
def test_checkpoint_restore(arch):
    model = build_ours(arch)
    cache = model.make_cache()
    model(mx.array([PROMPT]), cache)
    ckpt = cache.checkpoint()
    first = _continue(model, cache)
    assert cache.offsets[0] == len(PROMPT) + len(AFTER)
    cache.restore(ckpt)
    assert cache.offsets == [len(PROMPT)]
    assert _diff(first, _continue(model, cache)) == 0.0
    recurrent = [c for c in cache.layers if isinstance(c, RecurrentCache)]
    assert ckpt.nbytes == sum(c.state.nbytes + c.conv.nbytes for c in recurrent)
    held = [pair for pair in ckpt.recurrent if pair]
    assert all(a is not None for pair in held for a in pair)


def test_rollback_after_a_padded_verify_batch():
    """Drafts of different lengths are padded to one T; rollback counts from each row's length."""
    model = build_ours("qwen3_5_moe")
    cache = model.make_cache(2)
    model(mx.array([PROMPT, PROMPT[::-1]]), cache)
    drafts = mx.array([DRAFT[:5], DRAFT[:3] + [0, 0]])
    model(drafts, cache, lengths=[5, 3], record=True)
    cache.rollback([1, 2])
    assert cache.offsets == [len(PROMPT) + 4, len(PROMPT) + 1]
    step = model(mx.array([[77], [77]]), cache)[:, -1]
    for b, kept in enumerate([DRAFT[:4], DRAFT[:1]]):
        solo = model.make_cache()
        model(mx.array([(PROMPT if b == 0 else PROMPT[::-1]) + kept]), solo)
        assert mx.abs(step[b] - model(mx.array([[77]]), solo)[0, -1]).max().item() < 1e-4
    with pytest.raises(ValueError):  # cannot drop more than the row consumed
        model(drafts, cache, lengths=[5, 3], record=True)
        cache.rollback([0, 4])


def test_conv_rows_at_matches_conv_state_after() -> None:
    """The compiled rollback's conv rows (start as an array) equal `conv_state_after`'s."""
    from kapitsa.engine.cache.replay import conv_rows_at
    from kapitsa.engine.ops.conv import conv_state_after

    conv_in = mx.random.normal((3, 3 + 6, 5))  # kernel 4: 3 rows before + 6 new
    for kept in ([6, 6, 6], [0, 3, 6], [1, 5, 2]):
        got = conv_rows_at(conv_in, mx.array(kept, dtype=mx.int32), 4)
        assert mx.array_equal(got, conv_state_after(conv_in, kept, 4)).item(), kept
