"""Radix tree, eviction and disk tier with fake payloads: KV arrays [1, 1, T, 1] hold token ids."""

from __future__ import annotations

import mlx.core as mx
import pytest

from kapitsa.engine.cache.disk import DiskTier
from kapitsa.engine.cache.prefix import PrefixCache


def _kv(tokens):
    def source(start: int, end: int):
        span = mx.array(tokens[start:end], dtype=mx.float32).reshape(1, 1, -1, 1)
        return (span, span * 2)

    return source


def _state(tag: float):
    return (mx.full((1, 4), tag),)


def _kv_tokens(match) -> list[int]:
    return [int(x) for x in match.kv[0].reshape(-1).tolist()]


def _insert(cache: PrefixCache, tokens, tag: float, kind: str = "turn", **kw) -> None:
    cache.insert(tokens, recurrent=_state(tag), kv_source=_kv(list(tokens)), kind=kind, **kw)


def test_lookup_returns_deepest_checkpoint_with_kv_for_its_prefix() -> None:
    cache = PrefixCache(budget_bytes=1 << 20)
    conv = list(range(100, 130))
    _insert(cache, conv[:10], 1.0, "system")
    _insert(cache, conv[:20], 2.0)
    match = cache.lookup(conv + [7, 8])
    assert match.pos == 20 and match.recurrent[0].tolist() == [[2.0] * 4]
    assert _kv_tokens(match) == conv[:20]
    assert match.kv[1].reshape(-1).tolist() == [2 * t for t in conv[:20]]
    # a diverging prompt falls back to the shallower checkpoint
    match = cache.lookup(conv[:15] + [1, 2, 3])
    assert match.pos == 10 and _kv_tokens(match) == conv[:10]
    assert cache.lookup([1, 2, 3]) is None


def test_exact_hit_needs_next_logits() -> None:
    cache = PrefixCache(budget_bytes=1 << 20)
    toks = list(range(10))
    _insert(cache, toks[:5], 1.0)
    _insert(cache, toks, 2.0)
    assert cache.lookup(toks).pos == 5  # must feed at least one token
    _insert(cache, [50, 51, 52], 3.0, next_logits=mx.zeros((8,)))
    assert cache.lookup([50, 51, 52]).pos == 3


def test_branches_share_kv_and_split_edges() -> None:
    cache = PrefixCache(budget_bytes=1 << 20)
    a = list(range(20))
    b = list(range(12)) + [99, 98, 97]
    _insert(cache, a, 1.0)
    kv_after_one = cache.kv_bytes
    _insert(cache, b, 2.0)
    # only b's 3 new tokens were added (2 arrays x 3 tokens x 4 bytes)
    assert cache.kv_bytes == kv_after_one + 3 * 2 * 4
    assert _kv_tokens(cache.lookup(b + [0])) == b
    assert _kv_tokens(cache.lookup(a + [0])) == a
    assert cache.match_length(list(range(12)) + [5]) == 12


def test_evicting_a_leaf_drops_the_kv_only_it_used() -> None:
    cache = PrefixCache(budget_bytes=1 << 20)
    base = list(range(10))
    _insert(cache, base, 1.0, "system")
    _insert(cache, base + [50, 51, 52, 53], 2.0)
    _insert(cache, base + [60, 61], 3.0)
    cache.lookup(base + [60, 61, 0])  # the 60-branch becomes most recently used
    before_kv = cache.kv_bytes
    cache.enforce_budget(cache.nbytes - 1)  # evict exactly one: the least recently used leaf
    assert cache.num_checkpoints == 2
    assert cache.kv_bytes == before_kv - 4 * 2 * 4  # its 4-token edge went with it
    assert cache.lookup(base + [50, 51, 52, 53, 0]).pos == 10
    assert cache.lookup(base + [60, 61, 0]).pos == 12


def test_system_checkpoint_is_evicted_last_and_budget_holds() -> None:
    cache = PrefixCache(budget_bytes=1 << 20)
    sys_prompt = list(range(30))
    _insert(cache, sys_prompt, 0.0, "system")
    for i in range(10):
        _insert(cache, sys_prompt + [1000 + i] * 5, float(i))
    budget = cache.nbytes // 2
    cache.budget_bytes = budget
    cache.enforce_budget()
    assert cache.nbytes <= budget
    assert cache.lookup(sys_prompt + [5]).pos == 30
    assert cache.lookup(sys_prompt + [1009] * 5 + [1]).pos == 35  # most recent survives
    assert cache.lookup(sys_prompt + [1000] * 5 + [1]).pos == 30


def test_internal_checkpoint_eviction_keeps_descendants() -> None:
    cache = PrefixCache(budget_bytes=1 << 20)
    toks = list(range(40))
    _insert(cache, toks[:10], 1.0)
    _insert(cache, toks[:30], 2.0)
    cache.lookup(toks[:30] + [0])  # the deeper one is newer
    cache.enforce_budget(cache.nbytes - 1)
    assert cache.num_checkpoints == 1
    assert cache.lookup(toks[:30] + [0]).pos == 30
    assert cache.lookup(toks[:20]) is None


def test_disk_tier_survives_restart(tmp_path) -> None:
    toks = list(range(200, 260))
    disk = DiskTier(tmp_path, model_key="m1", budget_bytes=1 << 20)
    cache = PrefixCache(budget_bytes=1 << 20, disk=disk)
    _insert(cache, toks[:40], 4.0, next_logits=mx.ones((8,)))
    cache.flush_to_disk()
    restarted = PrefixCache(
        budget_bytes=1 << 20, disk=DiskTier(tmp_path, model_key="m1", budget_bytes=1 << 20)
    )
    match = restarted.lookup(toks)
    assert match.from_disk and match.pos == 40 and _kv_tokens(match) == toks[:40]
    assert match.recurrent[0].tolist() == [[4.0] * 4]
    assert restarted.lookup(toks).pos == 40 and not restarted.lookup(toks).from_disk  # now in memory
    other_model = PrefixCache(
        budget_bytes=1 << 20, disk=DiskTier(tmp_path, model_key="m2", budget_bytes=1 << 20)
    )
    assert other_model.lookup(toks) is None


def test_eviction_spills_to_disk_and_reloads(tmp_path) -> None:
    disk = DiskTier(tmp_path, model_key="m", budget_bytes=1 << 20)
    cache = PrefixCache(budget_bytes=1 << 20, disk=disk)
    toks = list(range(30))
    _insert(cache, toks, 1.0)
    cache.enforce_budget(0)
    assert cache.nbytes == 0 and len(disk) == 1
    match = cache.lookup(toks + [1])
    assert match.from_disk and match.pos == 30


@pytest.mark.parametrize("damage", ["truncate", "garbage", "swap"])
def test_corrupt_file_is_deleted_and_missed(tmp_path, damage) -> None:
    disk = DiskTier(tmp_path, model_key="m", budget_bytes=1 << 20)
    cache = PrefixCache(budget_bytes=1 << 20, disk=disk)
    _insert(cache, list(range(30)), 1.0)
    _insert(cache, list(range(50, 70)), 2.0)
    cache.flush_to_disk()
    files = sorted(disk.folder.glob("*.safetensors"))
    assert len(files) == 2
    target = files[0]
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[:50])
    elif damage == "garbage":
        target.write_bytes(b"\x00" * 200)
    else:  # a valid file under the wrong name
        target.write_bytes(files[1].read_bytes())
    fresh = PrefixCache(budget_bytes=1 << 20, disk=DiskTier(tmp_path, model_key="m", budget_bytes=1 << 20))
    hits = [fresh.lookup(list(range(30)) + [0]), fresh.lookup(list(range(50, 70)) + [0])]
    assert sum(h is not None for h in hits) == 1  # the intact file still serves
    assert len(list(disk.folder.glob("*.safetensors"))) == 1


def test_corrupt_tensor_data_is_deleted_at_load(tmp_path) -> None:
    disk = DiskTier(tmp_path, model_key="m", budget_bytes=1 << 20)
    cache = PrefixCache(budget_bytes=1 << 20, disk=disk)
    _insert(cache, list(range(30)), 1.0)
    cache.flush_to_disk()
    (path,) = disk.folder.glob("*.safetensors")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 40])  # header intact, tensor bytes cut short
    fresh = PrefixCache(budget_bytes=1 << 20, disk=DiskTier(tmp_path, model_key="m", budget_bytes=1 << 20))
    assert fresh.lookup(list(range(30)) + [0]) is None
    assert not path.exists()


def test_disk_budget_is_respected(tmp_path) -> None:
    disk = DiskTier(tmp_path, model_key="m", budget_bytes=1 << 20)
    cache = PrefixCache(budget_bytes=1 << 20, disk=disk)
    _insert(cache, list(range(30)), 1.0)
    cache.flush_to_disk()
    one_file = disk.nbytes
    small = DiskTier(tmp_path / "b", model_key="m", budget_bytes=int(one_file * 2.5))
    cache = PrefixCache(budget_bytes=1 << 20, disk=small)
    for i in range(5):
        _insert(cache, [i] + list(range(1, 30)), float(i))
        cache.enforce_budget(0)
        assert small.nbytes <= small.budget_bytes
    assert len(small) == 2
    assert cache.lookup([4] + list(range(1, 30)) + [0]).pos == 30  # newest kept
    assert cache.lookup([0] + list(range(1, 30)) + [0]) is None


def test_insert_says_whether_it_made_a_new_checkpoint() -> None:
    cache = PrefixCache(budget_bytes=1 << 20)
    conv = list(range(100, 130))
    assert cache.insert(conv[:20], recurrent=_state(1.0), kv_source=_kv(conv)) is True
    assert cache.insert(conv[:20], recurrent=_state(2.0), kv_source=_kv(conv)) is False  # already there
    assert cache.insert(conv[:10], recurrent=_state(3.0), kv_source=_kv(conv)) is True  # splits the edge
    assert cache.num_checkpoints == 2
