"""Checkpoint files of the prefix cache's disk tier: checksums catch damage that leaves the header
intact, files and folders are private, and the background writer puts new turns on disk soon."""

from __future__ import annotations

import json
import os
import stat
import struct
import time
from pathlib import Path

import mlx.core as mx
import pytest

from kapitsa.engine.cache.disk import STALE_TMP_S, DiskTier, StoredPrefix
from kapitsa.engine.cache.file import (
    SUFFIX,
    TMP_PREFIX,
    CorruptPrefixFile,
    prepare_arrays,
    read_prefix_file,
    write_prefix_file,
)


def _stored(tokens: list[int], kind: str = "turn", tag: float = 1.0) -> StoredPrefix:
    kv = mx.array(tokens, dtype=mx.float32).reshape(1, 1, -1, 1)
    return StoredPrefix(tuple(tokens), ((kv, kv * 2),), (mx.full((1, 4), tag),), None, kind)


def _write(folder: Path) -> Path:
    arrays = {"a": mx.arange(12, dtype=mx.float32).reshape(3, 4), "b": mx.array([1, 2, 3], dtype=mx.int32)}
    return write_prefix_file(folder, "x", prepare_arrays(arrays), {"format": "test"})


def _data_start(path: Path) -> int:
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
    return 8 + size


def _rewrite_header(path: Path, edit) -> None:
    raw = path.read_bytes()
    start = _data_start(path)
    header = json.loads(raw[8:start])
    edit(header)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (start - 8 - len(encoded))  # the same length, so the data stays where it was
    path.write_bytes(raw[:8] + encoded + raw[start:])


def test_round_trip_and_private_modes(tmp_path: Path) -> None:
    path = _write(tmp_path)
    arrays, meta = read_prefix_file(path)
    assert arrays["a"].tolist() == mx.arange(12).reshape(3, 4).tolist() and meta["format"] == "test"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["x.safetensors"]  # no temporary file left


def test_flipped_data_under_an_intact_header_fails(tmp_path: Path) -> None:
    path = _write(tmp_path)
    raw = bytearray(path.read_bytes())
    raw[_data_start(path) + 5] ^= 0x40  # one bit of one float
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptPrefixFile, match="checksum"):
        read_prefix_file(path)


def test_an_edited_shape_fails(tmp_path: Path) -> None:
    path = _write(tmp_path)
    _rewrite_header(path, lambda h: h["a"].update(shape=[4, 3]))  # same bytes, other shape
    with pytest.raises(CorruptPrefixFile, match="checksum"):
        read_prefix_file(path)


@pytest.mark.parametrize("keep", [4, 20, -3])
def test_a_cut_short_file_fails(tmp_path: Path, keep: int) -> None:
    path = _write(tmp_path)
    path.write_bytes(path.read_bytes()[:keep])
    with pytest.raises(CorruptPrefixFile):
        read_prefix_file(path)


def test_disk_tier_folders_are_private(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path / "cache", model_key="m", budget_bytes=1 << 20)
    disk.save(_stored(list(range(10))))
    (path,) = disk.folder.glob("*.safetensors")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(disk.folder.stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "cache").stat().st_mode) == 0o700


def test_a_checkpoint_that_does_not_fit_the_model_is_deleted_and_counted(tmp_path: Path) -> None:
    DiskTier(tmp_path, model_key="m", budget_bytes=1 << 20).save(_stored(list(range(10))))

    def validate(stored: StoredPrefix) -> None:
        if stored.recurrent[0].shape != (1, 8):
            raise ValueError("recurrent state of the wrong shape")

    disk = DiskTier(tmp_path, model_key="m", budget_bytes=1 << 20, validate=validate)
    assert disk.lookup(list(range(12))) is None
    assert disk.num_corrupt == 1 and len(disk) == 0
    assert list(disk.folder.glob("*.safetensors")) == []


def test_a_corrupt_file_is_deleted_and_counted_at_lookup(tmp_path: Path) -> None:
    DiskTier(tmp_path, model_key="m", budget_bytes=1 << 20).save(_stored(list(range(10))))
    disk = DiskTier(tmp_path, model_key="m", budget_bytes=1 << 20)
    (path,) = disk.folder.glob("*.safetensors")
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x01  # the recurrent state's last float
    path.write_bytes(bytes(raw))
    assert disk.lookup(list(range(12))) is None
    assert disk.num_corrupt == 1 and not path.exists()


def test_write_behind_reaches_disk_after_its_delay(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, model_key="m", budget_bytes=1 << 20, write_delay_s=2.0)
    disk.save_later(_stored(list(range(10))))
    assert len(disk) == 0 and disk.lookup(list(range(12))) is not None  # served from memory meanwhile
    deadline = time.monotonic() + 10.0
    while len(disk) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(disk) == 1
    fresh = DiskTier(tmp_path, model_key="m", budget_bytes=1 << 20)
    assert fresh.lookup(list(range(12))).tokens == tuple(range(10))


def test_a_turn_superseded_by_a_newer_turn_is_not_written(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, model_key="m", budget_bytes=1 << 20, write_delay_s=60.0)
    disk.save_later(_stored(list(range(5)), kind="system"))
    disk.save_later(_stored(list(range(10))))
    disk.save_later(_stored(list(range(20))))  # the same conversation, one turn on
    disk.flush()
    assert sorted(int(json.loads(_header(p))["__metadata__"]["pos"]) for p in disk.folder.iterdir()) == [
        5,
        20,
    ]


def _header(path: Path) -> bytes:
    return path.read_bytes()[8 : _data_start(path)]


def test_a_new_tier_removes_stale_temporary_files_and_keeps_a_live_write(tmp_path: Path) -> None:
    """Another process may be writing into the shared folder: only an old temporary file is debris."""
    folder = DiskTier(tmp_path, model_key="m", budget_bytes=1 << 20).folder
    stale, live = folder / f"{TMP_PREFIX}a{SUFFIX}", folder / f"{TMP_PREFIX}b{SUFFIX}"
    stale.write_bytes(b"torn"), live.write_bytes(b"in flight")
    old = time.time() - STALE_TMP_S - 60
    os.utime(stale, (old, old))
    DiskTier(tmp_path, model_key="m", budget_bytes=1 << 20)
    assert not stale.exists() and live.exists()
