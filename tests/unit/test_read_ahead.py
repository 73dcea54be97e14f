"""Read-ahead of disk-tier files, the idle preload of spilled checkpoints and the turn hints, with
fake payloads (KV [1, 1, T, 1] holds token ids)."""

from __future__ import annotations

import time

import mlx.core as mx

from kapitsa.engine.cache import disk as disk_module
from kapitsa.engine.cache.disk import DiskTier
from kapitsa.engine.cache.prefix import PrefixCache
from kapitsa.engine.cache.turn_hints import TurnHints


def _insert(cache: PrefixCache, tokens, tag: float, kind: str = "turn") -> None:
    def source(start: int, end: int):
        return (mx.array(tokens[start:end], dtype=mx.float32).reshape(1, 1, -1, 1),)

    cache.insert(tokens, recurrent=(mx.full((1, 4), tag),), kv_source=source, kind=kind)


def _spilled_cache(tmp_path) -> tuple[PrefixCache, list[int]]:
    cache = PrefixCache(budget_bytes=1 << 20, disk=DiskTier(tmp_path, model_key="m", budget_bytes=1 << 20))
    toks = list(range(100, 140))
    _insert(cache, toks, 3.0, "final")
    cache.enforce_budget(0)  # memory pressure: the checkpoint goes to disk
    assert cache.nbytes == 0
    return cache, toks


def test_a_file_read_ahead_serves_the_lookup_without_reading_it_again(tmp_path, monkeypatch) -> None:
    cache, toks = _spilled_cache(tmp_path)
    assert cache.read_ahead(toks + [1])
    monkeypatch.setattr(disk_module, "read_prefix_file", lambda path: 1 / 0)  # no read at lookup
    match = cache.lookup(toks + [1])
    assert match.from_disk and match.pos == 40 and match.recurrent[0].tolist() == [[3.0] * 4]
    assert cache.disk.read_ahead.num_taken == 1 and cache.disk.read_ahead.buffered_bytes == 0
    assert not cache.read_ahead(toks + [1])  # memory holds it now: nothing to read


def test_a_read_ahead_memory_made_useless_is_dropped(tmp_path) -> None:
    cache, toks = _spilled_cache(tmp_path)
    assert cache.read_ahead(toks + [1])
    _insert(cache, toks + [1, 2], 4.0)  # a deeper checkpoint in memory serves the prompt
    assert cache.lookup(toks + [1, 2, 3]).pos == 42
    deadline = time.monotonic() + 10.0  # a read in progress is dropped when it finishes
    while cache.disk.read_ahead.buffered_bytes and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cache.disk.read_ahead.buffered_bytes == 0 and cache.disk.read_ahead.num_taken == 0


def test_preload_brings_the_spilled_checkpoint_back_when_it_fits(tmp_path) -> None:
    cache, toks = _spilled_cache(tmp_path)
    size = cache.disk.entry_bytes(toks)
    assert not cache.preload(size - 1)  # no room yet
    assert cache.preload(size)
    match = cache.lookup(toks + [1])
    assert not match.from_disk and match.pos == 40 and cache.num_preloaded == 1
    assert not cache.preload(1 << 20)  # nothing left to load


def test_turn_hints_recall_the_last_request_of_a_conversation() -> None:
    hints = TurnHints(max_entries=2)
    first = [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}]
    hints.remember(first, [1, 2, 3, 4])
    follow_up = [*first, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    assert list(hints.recall(follow_up)) == [1, 2, 3, 4]
    assert hints.recall([{"role": "system", "content": "s"}, {"role": "user", "content": "z"}]) is None
    hints.remember([{"role": "user", "content": "x"}], [5])
    hints.remember([{"role": "user", "content": "y"}], [6])
    assert hints.recall(follow_up) is None  # the least recently used went first
