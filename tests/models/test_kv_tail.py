"""A decode step's K/V row written to the cache's tail (`KVCache.append_row`, the CUDA decode
kernel's path) holds what `KVCache.update` writes: the same keys for attention at every step, the
same buffers once folded, whatever reads the cache in between; and a model decoding through it
gives the plain path's logits (the kernel stood in for by its reference, which takes a tail too)."""

from __future__ import annotations

import mlx.core as mx
import pytest

import kapitsa.engine.models.base as base
from kapitsa.engine.cache.layers import KV_STEP, KVCache, StepInfo
from kapitsa.engine.kernels import attention, backend
from kapitsa.engine.models.base import use_kernel_options
from kapitsa.engine.options import KernelOptions
from tests.models.builders import build_ours, greedy_steps

HEADS, DIM = 2, 16


def _rows(batch: int, seed: int) -> tuple[mx.array, mx.array]:
    k = mx.random.normal((batch, HEADS, 1, DIM), key=mx.random.key(seed))
    return k, -k + seed


def _prefilled(batch: int, length: int) -> tuple[KVCache, KVCache]:
    k = mx.random.normal((batch, HEADS, length, DIM), key=mx.random.key(99))
    caches = KVCache(HEADS, DIM), KVCache(HEADS, DIM)
    for cache in caches:
        cache.update(k, k * 2, StepInfo(length, [length] * batch, [0] * batch))
    return caches


def _attended(keys, values, committed, tail_keys, tail_values, length) -> tuple[mx.array, mx.array]:
    """The keys and values the decode kernel reads: the buffers' first rows, then the tail's."""
    return attention.keys_read(keys, values, length, tail=(tail_keys, tail_values), committed=committed)


@pytest.mark.parametrize("batch", [1, 2])
def test_tail_rows_are_the_rows_update_writes(batch: int) -> None:
    plain, tailed = _prefilled(batch, 40)
    steps = KV_STEP + 60  # one full tail folded on the way, a second one pending at the end
    for i in range(steps):
        k, v = _rows(batch, i)
        info = StepInfo(1, [1] * batch, [40 + i] * batch)
        want_k, want_v = plain.update(k, v, info)
        got_k, got_v = _attended(*tailed.append_row(k, v, info), info.kv_len)
        assert mx.array_equal(got_k, want_k).item() and mx.array_equal(got_v, want_v).item()
    assert tailed._tail is not None and tailed._tail.count == steps - KV_STEP
    length = 40 + steps
    assert mx.array_equal(tailed.keys[:, :, :length], plain.keys[:, :, :length]).item()  # reading folds
    assert tailed._tail is None
    assert mx.array_equal(tailed.values[:, :, :length], plain.values[:, :, :length]).item()


def test_rows_at_different_positions_each_get_their_rows() -> None:
    """A batch whose rows sit at different positions (a server's conversations): each row's keys
    are the ones `update` writes at that row's offset, across a fold, and a row that moves on its
    own (one rewound) starts a new tail."""
    plain, tailed = _prefilled(3, 300)
    starts = [240, 300, 280]  # the furthest row not the first: a fold must reserve for it
    steps = KV_STEP + 5
    for i in range(steps):
        k, v = _rows(3, i)
        info = StepInfo(1, [1] * 3, [s + i for s in starts])
        want_k, want_v = plain.update(k, v, info)
        keys, values, committed, tail_k, tail_v = tailed.append_row(k, v, info)
        assert committed == (starts if i < KV_STEP else [s + KV_STEP for s in starts])
        for b, offset in enumerate(info.offsets):
            row = (keys[b : b + 1], values[b : b + 1], committed[b], tail_k[b : b + 1], tail_v[b : b + 1])
            got_k, got_v = _attended(*row, offset + 1)
            assert mx.array_equal(got_k, want_k[b : b + 1, :, : offset + 1]).item()
            assert mx.array_equal(got_v, want_v[b : b + 1, :, : offset + 1]).item()
    ends = [s + steps for s in starts]
    for b, end in enumerate(ends):  # reading folds each row's rows at its own positions
        assert mx.array_equal(tailed.keys[b, :, :end], plain.keys[b, :, :end]).item()
    moved = [ends[0], ends[1] - 3, ends[2]]  # row 1 rewound by a rejected draft
    k, v = _rows(3, 999)
    tailed.append_row(k, v, StepInfo(1, [1] * 3, [end - 1 for end in ends]))
    _, _, committed, _, _ = tailed.append_row(k, v, StepInfo(1, [1] * 3, moved))
    assert committed == moved


def test_a_rewound_position_starts_a_new_tail() -> None:
    """After a rollback (offsets back by a rejected draft's rows), the next row lands where
    `update` puts it; positions past it are scratch."""
    plain, tailed = _prefilled(1, 30)
    positions = [30, 31, 32, 33, 31, 32, 33, 34, 20]
    for i, position in enumerate(positions):
        k, v = _rows(1, i)
        info = StepInfo(1, [1], [position])
        want_k, want_v = plain.update(k, v, info)
        got_k, got_v = _attended(*tailed.append_row(k, v, info), info.kv_len)
        assert mx.array_equal(got_k, want_k).item() and mx.array_equal(got_v, want_v).item()


def test_readers_see_the_tail_and_writers_replace_it() -> None:
    plain, tailed = _prefilled(1, 10)
    k, v = _rows(1, 0)
    info = StepInfo(1, [1], [10])
    plain.update(k, v, info)
    tailed.append_row(k, v, info)
    tail_bytes = 2 * HEADS * KV_STEP * DIM * 4
    assert tailed.nbytes == plain.nbytes + tail_bytes and tailed._tail is not None  # counting folds nothing
    held = tailed.eval_arrays()  # what a forward evaluates: the buffers and the tail, as they are
    assert len(held) == 4 and tailed._tail is not None and held[2] is tailed._tail.keys
    assert all(mx.array_equal(a, b).item() for a, b in zip(tailed.slots(), plain.slots(), strict=True))
    assert tailed._tail is None and tailed.nbytes == plain.nbytes
    tailed.append_row(*_rows(1, 1), StepInfo(1, [1], [11]))
    tailed.set_slots(plain.slots())  # new contents replace the old ones, the pending row included
    assert tailed._tail is None
    assert mx.array_equal(tailed.keys, plain.keys).item()
    k, v = _rows(1, 2)
    tailed.append_row(k, v, StepInfo(1, [1], [11]))
    tailed.keys = plain.keys  # one side replaced: the other keeps the tail's row
    assert mx.array_equal(tailed.values[:, :, 11:12], v).item()


def test_the_tail_holds_rows_in_the_caches_dtype() -> None:
    cache = KVCache(HEADS, DIM)
    k = mx.zeros((1, HEADS, 4, DIM), mx.bfloat16)
    cache.update(k, k, StepInfo(4, [4], [0]))
    row = mx.ones((1, HEADS, 1, DIM), mx.float32)
    _, _, _, tail_keys, tail_values = cache.append_row(row, row, StepInfo(1, [1], [4]))
    assert tail_keys.dtype == tail_values.dtype == mx.bfloat16  # cast as `update` casts


def test_a_row_into_an_empty_cache() -> None:
    cache = KVCache(HEADS, DIM)
    k, v = _rows(1, 3)
    keys, values, committed, tail_keys, tail_values = cache.append_row(k, v, StepInfo(1, [1], [0]))
    assert committed == 0 and keys.shape[2] == KV_STEP
    assert mx.array_equal(tail_keys[:, :, :1], k).item()
    assert mx.array_equal(cache.keys[:, :, :1], k).item()


def test_decoding_through_the_tail_gives_the_plain_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled decode step's tail path (taken on CUDA with the attention kernel), run on the
    CPU with the kernel's reference standing in for it, against the plain path, over more steps
    than one tail holds."""
    model = build_ours("qwen3_5_dense", kernels=KernelOptions())
    prompts = [[3, 17, 5, 9], [7, 8, 9, 10]]  # two rows at one offset, as the kernel takes them
    steps = KV_STEP + 8

    def run() -> tuple[list[mx.array], object]:
        cache = model.make_cache(len(prompts))
        return greedy_steps(model, cache, model(mx.array(prompts), cache)[:, -1], steps), cache

    plain, plain_cache = run()
    use_kernel_options(model, KernelOptions())
    monkeypatch.setattr(base, "attention_usable", lambda q, k, v: True)
    monkeypatch.setattr(base, "decode_attention", attention.decode_attention_reference)
    tailed, tailed_cache = run()
    kv = [c for c in tailed_cache.layers if isinstance(c, KVCache)]
    assert kv and all(c._tail is not None for c in kv)  # the tail path ran
    mx.eval(*tailed_cache.state_arrays())
    assert all(c._tail is not None for c in kv)  # evaluating the cache folds nothing
    for a, b in zip(plain, tailed, strict=True):
        assert mx.allclose(a, b, atol=1e-5, rtol=1e-5).item(), float(mx.abs(a - b).max())
    for c, p in zip(kv, [c for c in plain_cache.layers if isinstance(c, KVCache)], strict=True):
        length = len(prompts[0]) + steps
        assert mx.allclose(c.keys[:, :, :length], p.keys[:, :, :length]).item()


def _kernel_by_its_reference(monkeypatch: pytest.MonkeyPatch) -> list:
    """The layers take the decode kernel, its reference standing in; returns the `length` of each call."""
    lengths = []

    def kernel(q, keys, values, length, **kw):  # noqa: ANN001, ANN003, ANN202
        lengths.append(length)
        return attention.decode_attention_reference(q, keys, values, length, **kw)

    monkeypatch.setattr(base, "attention_usable", lambda q, k, v: True)
    monkeypatch.setattr(base, "decode_attention", kernel)
    return lengths


def test_a_batch_at_different_positions_decodes_through_the_tail(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts of different lengths in one batch: every decode step takes the tail path (rows at
    their own positions) and gives the plain path's logits, over more steps than one tail holds."""
    model = build_ours("qwen3_5_dense", kernels=KernelOptions())
    prompts = [[3, 17, 5, 9, 11, 2], [7, 8, 0, 0, 0, 0], [4, 4, 4, 4, 0, 0]]
    lengths = [6, 2, 4]
    steps = KV_STEP + 4

    def run() -> list[mx.array]:
        cache = model.make_cache(len(prompts))
        hidden = model.forward(mx.array(prompts), cache, lengths=lengths).hidden
        return greedy_steps(model, cache, model.logits(model.last_hidden(hidden, lengths))[:, -1], steps)

    plain = run()
    calls = _kernel_by_its_reference(monkeypatch)
    tailed = run()
    assert calls and all(isinstance(c, list) and len(set(c)) == 3 for c in calls)  # three positions
    for a, b in zip(plain, tailed, strict=True):
        assert mx.allclose(a, b, atol=1e-5, rtol=1e-5).item(), float(mx.abs(a - b).max())


def test_an_exact_verify_at_different_positions_reads_what_its_decode_steps_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """KernelOptions.exact_verify over a batch whose rows sit at different positions: each draft
    token's attention takes the decode kernel over its own row's keys, as the decode step at that
    position does, and the verify's logits are the decode steps'."""
    model = build_ours("qwen3_5_dense", kernels=KernelOptions(exact_verify=True))
    prompts, lengths = [[3, 17, 5, 9, 11, 2], [7, 8, 0, 0, 0, 0]], [6, 2]
    draft = mx.array([[5, 6, 7, 8], [9, 10, 11, 12]], dtype=mx.int32)
    seen = _kernel_by_its_reference(monkeypatch)
    stepped, verified = model.make_cache(2), model.make_cache(2)
    for cache in (stepped, verified):
        model.forward(mx.array(prompts), cache, lengths=lengths)
    steps = [model(draft[:, t : t + 1], stepped)[:, 0] for t in range(4)]
    seen.clear()
    together = model(draft, verified, record=True)
    assert seen and seen[:4] == [[6 + t + 1, 2 + t + 1] for t in range(4)]  # each row's own keys
    for t, step in enumerate(steps):
        assert mx.allclose(step, together[:, t], atol=1e-5, rtol=1e-5).item(), t


@pytest.mark.gpu
@pytest.mark.skipif(backend() != "cuda", reason="needs CUDA")
def test_gpu_decode_steps_through_the_tail_match_the_reference() -> None:
    """The CUDA kernel over the cache and its tail, step by step across a fold, against MLX's
    attention over what `update` writes: the 4B's attention shape, bf16."""
    heads, kv_heads, dim, start = 16, 4, 256, 700
    prefill = mx.random.normal((1, kv_heads, start, dim), key=mx.random.key(7)).astype(mx.bfloat16)
    plain, tailed = KVCache(kv_heads, dim), KVCache(kv_heads, dim)
    for cache in (plain, tailed):
        cache.update(prefill, -prefill, StepInfo(start, [start], [0]))
    for i in range(KV_STEP + 20):
        keys = mx.random.split(mx.random.key(i), 3)
        q = mx.random.normal((1, heads, 1, dim), key=keys[0]).astype(mx.bfloat16)
        k = mx.random.normal((1, kv_heads, 1, dim), key=keys[1]).astype(mx.bfloat16)
        v = mx.random.normal((1, kv_heads, 1, dim), key=keys[2]).astype(mx.bfloat16)
        info = StepInfo(1, [1], [start + i])
        want_k, want_v = plain.update(k, v, info)
        want = attention.decode_attention_reference(q, want_k, want_v, info.kv_len, scale=dim**-0.5)
        buf_k, buf_v, committed, tail_k, tail_v = tailed.append_row(k, v, info)
        got = attention.decode_attention(
            q, buf_k, buf_v, info.kv_len, scale=dim**-0.5, tail=(tail_k, tail_v), committed=committed
        )
        assert mx.allclose(got.astype(mx.float32), want.astype(mx.float32), atol=2e-2, rtol=2e-2).item(), i
