"""The disk tier's budget holds for the whole cache folder: every model's subfolder counts, and the
least recently used file of any model is the one that goes."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import mlx.core as mx

from kapitsa.engine.cache.disk import DiskTier, StoredPrefix
from kapitsa.engine.cache.disk_budget import foreign_files
from kapitsa.engine.cache.file import SUFFIX, TMP_PREFIX


def _stored(first: int) -> StoredPrefix:
    """Ten tokens from `first` on: every such checkpoint has the same size on disk."""
    tokens = list(range(first, first + 10))
    kv = mx.array(tokens, dtype=mx.float32).reshape(1, 1, -1, 1)
    return StoredPrefix(tuple(tokens), ((kv, kv * 2),), (mx.full((1, 64), 1.0),), None, "turn")


def _file_bytes(tmp_path: Path) -> int:
    probe = DiskTier(tmp_path / "probe", model_key="probe", budget_bytes=1 << 20)
    probe.save(_stored(0))
    (path,) = probe.folder.glob(f"*{SUFFIX}")
    return path.stat().st_size


def _root_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob(f"*{SUFFIX}"))


def _age(disk: DiskTier, seconds: float) -> None:
    """Make every file of `disk` look `seconds` older (last use is a file's modification time)."""
    for path in disk.folder.glob(f"*{SUFFIX}"):
        then = path.stat().st_mtime - seconds
        os.utime(path, (then, then))


def test_the_budget_covers_every_models_folder(tmp_path: Path) -> None:
    size, root = _file_bytes(tmp_path), tmp_path / "cache"
    old_model = DiskTier(root, model_key="old", budget_bytes=3 * size + size // 2)
    for first in (0, 100):
        old_model.save(_stored(first))
    _age(old_model, 3600)
    new_model = DiskTier(root, model_key="new", budget_bytes=3 * size + size // 2)
    for first in (200, 300):
        new_model.save(_stored(first))
    assert _root_bytes(root) <= 3 * size + size // 2  # a budget per folder would hold 4 files here
    assert len(list(old_model.folder.glob(f"*{SUFFIX}"))) == 1  # the older model's oldest file went
    assert len(new_model) == 2


def test_a_recently_used_file_of_another_model_outlives_an_older_own_file(tmp_path: Path) -> None:
    size, root = _file_bytes(tmp_path), tmp_path / "cache"
    budget = 2 * size + size // 2
    mine = DiskTier(root, model_key="mine", budget_bytes=budget)
    mine.save(_stored(0))
    _age(mine, 3600)
    mine = DiskTier(root, model_key="mine", budget_bytes=budget)  # a restart reads the aged time
    other = DiskTier(root, model_key="other", budget_bytes=budget)
    other.save(_stored(100))
    mine.save(_stored(200))  # three files do not fit: the oldest is this model's own first one
    assert mine.lookup(list(range(12))) is None
    assert mine.lookup(list(range(200, 212))) is not None
    assert other.lookup(list(range(100, 112))) is not None


def test_files_being_written_elsewhere_are_neither_counted_nor_deleted(tmp_path: Path) -> None:
    size, root = _file_bytes(tmp_path), tmp_path / "cache"
    other = DiskTier(root, model_key="other", budget_bytes=1 << 20)
    live = other.folder / f"{TMP_PREFIX}x{SUFFIX}"
    live.write_bytes(b"\0" * (4 * size))  # another process's write in flight, larger than the budget
    mine = DiskTier(root, model_key="mine", budget_bytes=2 * size)
    mine.save(_stored(0))
    assert live.exists() and len(mine) == 1
    assert foreign_files(root, {mine.folder / p.name for p in mine.folder.iterdir()}) == []


def test_foreign_files_are_listed_least_recently_used_first(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    a = DiskTier(root, model_key="a", budget_bytes=1 << 20)
    b = DiskTier(root, model_key="b", budget_bytes=1 << 20)
    a.save(_stored(0))
    b.save(_stored(100))
    _age(b, 60)
    listed = foreign_files(root)
    assert [f.path.parent for f in listed] == [b.folder, a.folder]
    assert all(f.last_used <= time.time() for f in listed)


def test_files_the_tier_did_not_name_are_left_alone(tmp_path: Path) -> None:
    """A cache folder set to a shared place keeps whatever else lives there."""
    size, root = _file_bytes(tmp_path), tmp_path / "cache"
    stranger = root / "my-model" / "model.safetensors"
    stranger.parent.mkdir(parents=True)
    stranger.write_bytes(b"\0" * (4 * size))
    mine = DiskTier(root, model_key="mine", budget_bytes=2 * size + size // 2)
    odd = mine.folder / f"notes{SUFFIX}"
    odd.write_bytes(b"\0" * (4 * size))
    for first in (0, 100, 200):
        mine.save(_stored(first))
    assert stranger.exists() and odd.exists()
    assert len(mine) == 2  # its own files kept to the budget, the others not counted


def test_two_processes_serving_one_model_keep_one_budget(tmp_path: Path) -> None:
    """run, serve and the TUI share a model's folder: each counts the files the others wrote."""
    size, root = _file_bytes(tmp_path), tmp_path / "cache"
    budget = 3 * size + size // 2
    first, second = (DiskTier(root, model_key="m", budget_bytes=budget) for _ in range(2))
    for start in (0, 100, 200):
        first.save(_stored(start))
    for start in (300, 400, 500):
        second.save(_stored(start))
    assert _root_bytes(root) <= budget
    assert second.lookup(list(range(500, 512))) is not None


def test_a_restart_keeps_files_the_tier_did_not_name(tmp_path: Path) -> None:
    mine = DiskTier(tmp_path / "cache", model_key="mine", budget_bytes=1 << 20)
    odd = mine.folder / f"notes{SUFFIX}"
    odd.write_bytes(b"\0" * 64)
    again = DiskTier(tmp_path / "cache", model_key="mine", budget_bytes=1 << 20)
    assert odd.exists() and again.num_corrupt == 0


def test_a_file_renamed_into_place_but_not_yet_indexed_is_not_counted_twice(
    tmp_path: Path, monkeypatch
) -> None:
    """Two writes at once in one process (the writer thread, an eviction's save): the listing one
    of them makes must not count the other's file as another process's."""
    import threading

    from kapitsa.engine.cache import disk as disk_module

    size, root = _file_bytes(tmp_path), tmp_path / "cache"
    tier = DiskTier(root, model_key="m", budget_bytes=4 * size + size // 2)  # room for 4 files
    for first in (0, 100):
        tier.save(_stored(first))
    written, listed, second_done = threading.Event(), threading.Event(), threading.Event()
    real_write, real_foreign = disk_module.write_prefix_file, tier._foreign_files

    def write(*args, **kwargs):  # the second writer's file is in place, not yet in the index
        path = real_write(*args, **kwargs)
        if threading.current_thread().name == "second":
            written.set()
            listed.wait(10)
        return path

    def foreign():  # the first writer lists the folder meanwhile; the second then indexes its file
        found = real_foreign()
        if threading.current_thread().name == "first":
            listed.set()
            second_done.wait(10)
        return found

    monkeypatch.setattr(disk_module, "write_prefix_file", write)
    monkeypatch.setattr(tier, "_foreign_files", foreign)
    second = threading.Thread(target=lambda: (tier.save(_stored(200)), second_done.set()), name="second")
    second.start()
    written.wait(10)
    first = threading.Thread(target=lambda: tier.save(_stored(300)), name="first")
    first.start()
    first.join(10)
    second.join(10)
    assert len(list(tier.folder.glob(f"*{SUFFIX}"))) == len(tier) == 4  # all four fit: none deleted


def test_closing_writes_what_is_queued_and_ends_the_writer_at_once(tmp_path: Path) -> None:
    """The writer thread holds the tier and, through `validate`, a stopped engine's model: closing
    ends it without its idle wait, so that memory can be freed."""
    disk = DiskTier(tmp_path, model_key="m", budget_bytes=1 << 20, write_delay_s=30.0)
    disk.save_later(_stored(1))
    disk.close(timeout=10.0)
    assert len(disk) == 1
    deadline = time.monotonic() + 2.0
    while any(t.name == "kapitsa-disk-writer" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the writer outlived the close by 2 s (its idle wait is 30 s)"
        time.sleep(0.01)
