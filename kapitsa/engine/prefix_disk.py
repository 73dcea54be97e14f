"""Disk tier of the prefix cache: one safetensors file per checkpointed prefix.

A file holds the prefix's token ids, the KV of the whole prefix, the recurrent state at its end and
optionally the next-token logits; its metadata names the format and the prefix length. Files live in
a folder per model key, so a restart with the same model finds them again. A file that fails to load
or does not match its name is deleted and treated as a miss. The folder is kept under a byte budget by
deleting the least recently used files.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

log = logging.getLogger(__name__)

FORMAT = "kapitsa-prefix-v1"
SUFFIX = ".safetensors"


@dataclass(slots=True, frozen=True)
class StoredPrefix:
    tokens: tuple[int, ...]
    kv: tuple[mx.array, ...]
    recurrent: tuple[mx.array, ...]
    next_logits: mx.array | None
    kind: str


@dataclass(slots=True)
class _Entry:
    path: Path
    pos: int
    has_logits: bool
    nbytes: int
    last_used: float


def prefix_digest(tokens: Sequence[int]) -> str:
    return hashlib.sha256(np.asarray(tokens, dtype=np.int64).tobytes()).hexdigest()[:32]


def _prefix_digests(tokens: Sequence[int], positions: Sequence[int]) -> dict[int, str]:
    """sha256 of tokens[:p] for each p, hashing the prompt once (incrementally)."""
    data = np.asarray(tokens, dtype=np.int64)
    hasher = hashlib.sha256()
    done, out = 0, {}
    for pos in sorted(set(positions)):
        hasher.update(data[done:pos].tobytes())
        done = pos
        out[pos] = hasher.copy().hexdigest()[:32]
    return out


def read_metadata(path: Path) -> dict[str, str]:
    """The `__metadata__` of a safetensors file, from its header alone."""
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        if size > 100 * 1024 * 1024:
            raise ValueError("header too large")
        header = json.loads(f.read(size))
    return header.get("__metadata__", {})


class DiskTier:
    """Saves and finds prefix checkpoints in `root / model_key-digest`.

    Args:
        root: the cache folder (created if missing).
        model_key: identifies model weights, dtype and template; entries of other models are ignored.
        budget_bytes: the most the folder may hold.
    """

    def __init__(self, root: Path, *, model_key: str, budget_bytes: int) -> None:
        self.folder = Path(root) / hashlib.sha256(model_key.encode()).hexdigest()[:16]
        self.folder.mkdir(parents=True, exist_ok=True)
        self.budget_bytes = budget_bytes
        self._entries: dict[str, _Entry] = {}
        self._nbytes = 0
        self._scan()

    @property
    def nbytes(self) -> int:
        return self._nbytes  # a running total: other threads read it while the engine writes

    def __len__(self) -> int:
        return len(self._entries)

    def _scan(self) -> None:
        for path in self.folder.glob(f"*{SUFFIX}"):
            if path.name.startswith("tmp-"):
                path.unlink(missing_ok=True)  # a write that a crash interrupted
                continue
            try:
                meta = read_metadata(path)
                digest = path.name.removesuffix(SUFFIX)
                if meta.get("format") != FORMAT or meta.get("digest") != digest:
                    raise ValueError("not a kapitsa prefix file, or not the one its name says")
                stat = path.stat()
                has_logits = meta.get("has_logits") == "1"
                self._add(digest, _Entry(path, int(meta["pos"]), has_logits, stat.st_size, stat.st_mtime))
            except (OSError, ValueError, KeyError, struct.error) as err:
                log.warning("deleting unreadable prefix-cache file %s: %s", path.name, err)
                path.unlink(missing_ok=True)

    def save(self, stored: StoredPrefix) -> None:
        digest = prefix_digest(stored.tokens)
        if digest in self._entries:
            self._touch(self._entries[digest])
            return
        arrays = {"tokens": mx.array(np.asarray(stored.tokens, dtype=np.int32))}
        arrays.update({f"kv.{i}": a for i, a in enumerate(stored.kv)})
        arrays.update({f"rec.{i}": a for i, a in enumerate(stored.recurrent)})
        if stored.next_logits is not None:
            arrays["next_logits"] = stored.next_logits
        metadata = {
            "format": FORMAT,
            "digest": digest,
            "pos": str(len(stored.tokens)),
            "kind": stored.kind,
            "has_logits": "1" if stored.next_logits is not None else "0",
        }
        size = sum(a.nbytes for a in arrays.values())
        if size > self.budget_bytes:
            return
        self._make_room(size)
        final = self.folder / f"{digest}{SUFFIX}"
        tmp = self.folder / f"tmp-{digest}{SUFFIX}"
        try:
            mx.save_safetensors(str(tmp), arrays, metadata=metadata)
            os.replace(tmp, final)
        except OSError as err:
            log.warning("could not write prefix-cache file: %s", err)
            tmp.unlink(missing_ok=True)
            return
        entry = _Entry(final, len(stored.tokens), stored.next_logits is not None, final.stat().st_size, 0.0)
        self._touch(entry)
        self._add(digest, entry)
        self._make_room(0)  # the header makes the file a little larger than its arrays

    def lookup(self, tokens: Sequence[int], *, min_pos: int = 1) -> StoredPrefix | None:
        """The longest stored prefix of `tokens` (at least `min_pos` long) that loads cleanly."""
        n = len(tokens)
        positions = {e.pos for e in self._entries.values() if min_pos <= e.pos <= n}
        if not positions:
            return None
        digests = _prefix_digests(tokens, positions)
        for pos in sorted(positions, reverse=True):
            entry = self._entries.get(digests[pos])
            if entry is None or entry.pos != pos or (pos == n and not entry.has_logits):
                continue
            stored = self._load(digests[pos], entry, tokens[:pos])
            if stored is not None:
                return stored
        return None

    def _load(self, digest: str, entry: _Entry, expected: Sequence[int]) -> StoredPrefix | None:
        try:
            arrays, meta = mx.load(str(entry.path), return_metadata=True)
            tokens = tuple(np.asarray(arrays["tokens"]).tolist())
            if meta.get("format") != FORMAT or tokens != tuple(expected):
                raise ValueError("contents do not match the file name")
            kv = _numbered(arrays, "kv")
            recurrent = _numbered(arrays, "rec")
            mx.eval(*kv, *recurrent)
        except Exception as err:  # noqa: BLE001 - any failure to read means: delete and miss
            log.warning("deleting corrupt prefix-cache file %s: %s", entry.path.name, err)
            self._delete(digest)
            return None
        self._touch(entry)
        return StoredPrefix(tokens, kv, recurrent, arrays.get("next_logits"), meta.get("kind", "turn"))

    def _touch(self, entry: _Entry) -> None:
        newest = max((e.last_used for e in self._entries.values()), default=0.0)
        entry.last_used = max(time.time(), newest + 0.001)  # strictly newest, even within one clock tick
        with contextlib.suppress(OSError):
            os.utime(entry.path, (entry.last_used, entry.last_used))

    def _make_room(self, incoming: int) -> None:
        while self._entries and self.nbytes + incoming > self.budget_bytes:
            oldest = min(self._entries, key=lambda d: self._entries[d].last_used)
            self._delete(oldest)

    def _add(self, digest: str, entry: _Entry) -> None:
        self._entries[digest] = entry
        self._nbytes += entry.nbytes

    def _delete(self, digest: str) -> None:
        entry = self._entries.pop(digest, None)
        if entry is not None:
            self._nbytes -= entry.nbytes
            entry.path.unlink(missing_ok=True)


def _numbered(arrays: dict[str, mx.array], prefix: str) -> tuple[mx.array, ...]:
    count = sum(1 for name in arrays if name.startswith(prefix + "."))
    return tuple(arrays[f"{prefix}.{i}"] for i in range(count))
