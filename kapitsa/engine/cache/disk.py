"""Disk tier of the prefix cache: one checksummed safetensors file per checkpointed prefix.

A file holds the prefix's token ids, the KV of the whole prefix (one array per tree edge it spans),
the recurrent state at its end and optionally the next-token logits; its metadata names the format,
the prefix length and a checksum per array (file.py). Files live in a 0700 folder per model
key, so a restart with the same model finds them again. A file that fails its checksum, does not
match its name or does not fit the model is deleted, counted in `num_corrupt` and missed. The folder
is kept under a byte budget, every model's folder together, by deleting the least recently used
files (disk_budget.py).

`save` writes at once (eviction, shutdown); `save_later` hands a checkpoint to a background writer
that writes it `write_delay_s` later unless a newer turn of the same conversation supersedes it, so a
crash loses at most the last seconds of checkpoints.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from kapitsa.engine.cache.disk_budget import ForeignFile, foreign_files, is_tier_file
from kapitsa.engine.cache.file import (
    SUFFIX,
    TMP_PREFIX,
    CorruptPrefixFile,
    PreparedArray,
    arrays_from_bytes,
    prepare_arrays,
    read_metadata,
    read_prefix_file,
    write_prefix_file,
)
from kapitsa.engine.cache.read_ahead import ReadAhead
from kapitsa.engine.options import READ_AHEAD_BYTES
from kapitsa.private_files import make_private_dir

log = logging.getLogger(__name__)

FORMAT = "kapitsa-prefix-v2"
WRITE_DELAY_S = 1.0  # a burst of agent requests writes only its last turn
MAX_PENDING = 16  # checkpoints waiting for the writer; more are left to eviction and shutdown
_WRITER_IDLE_S = 30.0  # the writer thread ends after this long without work


@dataclass(slots=True, frozen=True)
class StoredPrefix:
    tokens: tuple[int, ...]
    kv_parts: tuple[tuple[mx.array, ...], ...]  # consecutive token spans, each one array per KV slot
    recurrent: tuple[mx.array, ...]
    next_logits: mx.array | None
    kind: str


Validate = Callable[[StoredPrefix], None]  # raises ValueError when a checkpoint does not fit the model


@dataclass(slots=True)
class _Entry:
    path: Path
    pos: int
    has_logits: bool
    nbytes: int
    last_used: float


@dataclass(slots=True)
class _Pending:
    stored: StoredPrefix
    arrays: list[PreparedArray]
    metadata: dict[str, str]
    due: float


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


def _file_arrays(stored: StoredPrefix) -> dict[str, mx.array]:
    arrays = {"tokens": mx.array(np.asarray(stored.tokens, dtype=np.int32))}
    for part, span in enumerate(stored.kv_parts):
        arrays.update({f"kv.{slot}.{part}": a for slot, a in enumerate(span)})
    arrays.update({f"rec.{i}": a for i, a in enumerate(stored.recurrent)})
    if stored.next_logits is not None:
        arrays["next_logits"] = stored.next_logits
    return arrays


def _file_metadata(stored: StoredPrefix, digest: str) -> dict[str, str]:
    return {
        "format": FORMAT,
        "digest": digest,
        "pos": str(len(stored.tokens)),
        "kind": stored.kind,
        "has_logits": "1" if stored.next_logits is not None else "0",
        "kv_parts": str(len(stored.kv_parts)),
    }


def _stored_from_file(
    arrays: dict[str, mx.array], meta: dict[str, str], expected: Sequence[int]
) -> StoredPrefix:
    tokens = tuple(np.asarray(arrays["tokens"]).tolist())
    if meta.get("format") != FORMAT or tokens != tuple(expected):
        raise CorruptPrefixFile("contents do not match the file name")
    num_parts = int(meta.get("kv_parts", "0"))
    num_slots = sum(1 for name in arrays if name.startswith("kv.") and name.endswith(".0"))
    kv_parts = tuple(tuple(arrays[f"kv.{s}.{p}"] for s in range(num_slots)) for p in range(num_parts))
    recurrent = tuple(arrays[f"rec.{i}"] for i in range(sum(1 for n in arrays if n.startswith("rec."))))
    return StoredPrefix(tokens, kv_parts, recurrent, arrays.get("next_logits"), meta.get("kind", "turn"))


STALE_TMP_S = 3600.0  # a temporary file this old belongs to no live write


def _age_s(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return 0.0  # its writer just renamed or removed it


class DiskTier:
    """Saves and finds prefix checkpoints in `root / model_key-digest`.

    Args:
        root: the cache folder (created 0700 if missing).
        model_key: identifies model weights, dtype and template; entries of other models are ignored.
        budget_bytes: the most `root` may hold, every model's folder in it together.
        validate: raises ValueError for a loaded checkpoint whose arrays do not fit the model.
        write_delay_s: how long `save_later` waits before writing (a newer turn may supersede it).
        read_ahead_bytes: the most that files read ahead of their lookup may hold (read_ahead.py).
    """

    def __init__(
        self,
        root: Path,
        *,
        model_key: str,
        budget_bytes: int,
        validate: Validate | None = None,
        write_delay_s: float = WRITE_DELAY_S,
        read_ahead_bytes: int = READ_AHEAD_BYTES,
    ) -> None:
        make_private_dir(Path(root))
        self.folder = make_private_dir(Path(root) / hashlib.sha256(model_key.encode()).hexdigest()[:16])
        self.budget_bytes = budget_bytes
        self.validate = validate
        self.write_delay_s = write_delay_s
        self.num_corrupt = 0  # files deleted because their bytes or shapes were wrong
        self.num_loaded = 0  # checkpoints a lookup loaded from a file
        self.read_ahead = ReadAhead(read_ahead_bytes)
        self._entries: dict[str, _Entry] = {}
        self._nbytes = 0
        self._cond = threading.Condition()  # guards everything below and the entries
        self._pending: dict[str, _Pending] = {}
        self._queue: collections.deque[str] = collections.deque()
        self._writing: set[str] = set()
        self._writer: threading.Thread | None = None
        self._flushing = False
        self._closed = False  # the engine stopped: the writer ends once the queue is empty
        self._scan()

    @property
    def nbytes(self) -> int:
        return self._nbytes  # a running total: other threads read it while the engine writes

    def __len__(self) -> int:
        return len(self._entries)

    def _scan(self) -> None:
        for path in self.folder.glob(f"*{SUFFIX}"):
            if path.name.startswith(TMP_PREFIX):
                # a write that a crash interrupted; a recent one may be another process's live write
                # (run, serve and the TUI share this folder), so only old ones go
                if _age_s(path) > STALE_TMP_S:
                    path.unlink(missing_ok=True)
                continue
            if not is_tier_file(path.name):
                continue  # not a name the tier gives its files: someone else's
            try:
                meta = read_metadata(path)
                digest = path.name.removesuffix(SUFFIX)
                if meta.get("format") != FORMAT or meta.get("digest") != digest:
                    raise ValueError("not a current kapitsa prefix file, or not the one its name says")
                stat = path.stat()
                has_logits = meta.get("has_logits") == "1"
                self._add(digest, _Entry(path, int(meta["pos"]), has_logits, stat.st_size, stat.st_mtime))
            except CorruptPrefixFile as err:
                self._drop_corrupt(path, err)
            except (OSError, ValueError, KeyError) as err:
                log.info("deleting prefix-cache file %s: %s", path.name, err)
                path.unlink(missing_ok=True)

    # writing

    def save(self, stored: StoredPrefix) -> None:
        """Write a checkpoint now (a pending write of it is taken over)."""
        digest = prefix_digest(stored.tokens)
        with self._cond:
            while digest in self._writing:
                self._cond.wait()
            if digest in self._entries:
                self._touch(self._entries[digest])
                return
            item = self._pending.pop(digest, None)
            self._writing.add(digest)
        try:
            item = item or self._prepare(stored, digest, due=0.0)
        except BaseException:
            self._finish_writing(digest)
            raise
        self._write(digest, item)

    def save_later(self, stored: StoredPrefix) -> None:
        """Queue a checkpoint for the background writer; dropped when MAX_PENDING are waiting."""
        digest = prefix_digest(stored.tokens)
        with self._cond:
            known = digest in self._entries or digest in self._pending or digest in self._writing
            if known or len(self._pending) >= MAX_PENDING:
                return
        item = self._prepare(stored, digest, due=time.monotonic() + self.write_delay_s)
        with self._cond:
            self._pending[digest] = item
            self._queue.append(digest)
            if self._writer is None:
                self._writer = threading.Thread(
                    target=self._write_loop, name="kapitsa-disk-writer", daemon=True
                )
                self._writer.start()
            self._cond.notify_all()

    def flush(self, timeout: float = 60.0) -> None:
        """Write every queued checkpoint now and wait for the writer to finish them."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._flushing = True
            self._cond.notify_all()
            while (self._pending or self._writing) and time.monotonic() < deadline:
                self._cond.wait(max(0.0, deadline - time.monotonic()))
            self._flushing = False

    def close(self, timeout: float = 60.0) -> None:
        """`flush`, then have the writer thread end at once rather than after its idle wait: it
        holds this tier and, through `validate`, the model, whose memory a stopped engine frees."""
        self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _prepare(self, stored: StoredPrefix, digest: str, *, due: float) -> _Pending:
        return _Pending(stored, prepare_arrays(_file_arrays(stored)), _file_metadata(stored, digest), due)

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                digest = self._next_due()
                if digest is None:
                    self._writer = None
                    return
                item = self._pending.pop(digest)
                if self._superseded(item):
                    self._cond.notify_all()
                    continue
                self._writing.add(digest)
            self._write(digest, item)

    def _next_due(self) -> str | None:
        """The next queued digest once its delay is over (None: idle long enough to stop)."""
        idle_since = time.monotonic()
        while True:
            if not self._queue:
                if self._closed or time.monotonic() - idle_since >= _WRITER_IDLE_S:
                    return None
                self._cond.wait(_WRITER_IDLE_S)
                continue
            digest = self._queue[0]
            item = self._pending.get(digest)
            if item is None:  # `save` took it over
                self._queue.popleft()
                continue
            wait = item.due - time.monotonic()
            if wait <= 0 or self._flushing:
                self._queue.popleft()
                return digest
            self._cond.wait(wait)

    def _superseded(self, item: _Pending) -> bool:
        """A turn whose conversation has a newer pending turn: the newer one serves its next request."""
        tokens = item.stored.tokens
        return item.stored.kind == "turn" and any(
            other.stored.kind == "turn" and len(other.stored.tokens) > len(tokens)
            and other.stored.tokens[: len(tokens)] == tokens
            for other in self._pending.values()
        )  # fmt: skip

    def _write(self, digest: str, item: _Pending) -> None:
        try:
            size = sum(a.nbytes for a in item.arrays)
            if size > self.budget_bytes:
                return
            foreign = self._foreign_files()
            with self._cond:
                self._make_room(size, foreign)
            path = write_prefix_file(self.folder, digest, item.arrays, item.metadata)
            entry = _Entry(path, len(item.stored.tokens), item.stored.next_logits is not None, 0, 0.0)
            entry.nbytes = path.stat().st_size
            with self._cond:
                self._touch(entry)
                self._add(digest, entry)
                self._make_room(0, foreign)  # the header makes the file a little larger than its arrays
        except Exception as err:  # noqa: BLE001 - a failed write only loses a cache entry
            log.warning("could not write prefix-cache file: %s", err)
        finally:
            self._finish_writing(digest)

    def _finish_writing(self, digest: str) -> None:
        with self._cond:
            self._writing.discard(digest)
            self._cond.notify_all()

    # reading

    def lookup(self, tokens: Sequence[int], *, min_pos: int = 1) -> StoredPrefix | None:
        """The longest stored prefix of `tokens` (at least `min_pos` long) that loads cleanly."""
        found = None
        for pos, digest in self._candidates(tokens, 1):
            if found is None and pos >= min_pos:
                found = self._find(digest, tokens[:pos])
            else:  # memory or a deeper file serves this prompt: its read-ahead is not needed
                self.read_ahead.discard(digest)
        return found

    def load_exact(self, tokens: Sequence[int]) -> StoredPrefix | None:
        """The checkpoint stored for exactly `tokens`, if one loads cleanly."""
        return self._find(prefix_digest(tokens), tokens)

    def entry_bytes(self, tokens: Sequence[int]) -> int | None:
        """The size of the file stored for exactly `tokens` (None: no such file)."""
        with self._cond:
            entry = self._entries.get(prefix_digest(tokens))
            return entry.nbytes if entry is not None else None

    def read_ahead_for(self, tokens: Sequence[int], *, min_pos: int = 1) -> bool:
        """Start reading the file `lookup(tokens, min_pos=...)` would load first; False: none to read."""
        for _, digest in self._candidates(tokens, min_pos):
            with self._cond:
                if digest in self._pending:
                    return False  # still in memory, waiting for the writer
                entry = self._entries.get(digest)
            if entry is not None:
                return self.read_ahead.request(digest, entry.path, entry.nbytes)
        return False

    def _candidates(self, tokens: Sequence[int], min_pos: int) -> list[tuple[int, str]]:
        """(position, digest) of every stored prefix of `tokens` from `min_pos` on, deepest first."""
        n = len(tokens)
        with self._cond:
            known = [(e.pos, e.has_logits) for e in self._entries.values()]
            known += [
                (len(p.stored.tokens), p.stored.next_logits is not None) for p in self._pending.values()
            ]
        positions = {pos for pos, has_logits in known if min_pos <= pos <= n and (pos < n or has_logits)}
        if not positions:
            return []
        digests = _prefix_digests(tokens, positions)
        return [(pos, digests[pos]) for pos in sorted(positions, reverse=True)]

    def _find(self, digest: str, expected: Sequence[int]) -> StoredPrefix | None:
        with self._cond:
            pending = self._pending.get(digest)
            entry = self._entries.get(digest)
        if pending is not None:
            return pending.stored
        if entry is None or entry.pos != len(expected):
            return None
        return self._load(digest, entry, expected)

    def _load(self, digest: str, entry: _Entry, expected: Sequence[int]) -> StoredPrefix | None:
        try:
            arrays, meta = self._read(digest, entry.path)
            stored = _stored_from_file(arrays, meta, expected)
            if self.validate is not None:
                self.validate(stored)
        except Exception as err:  # noqa: BLE001 - any failure to read means: delete and miss
            with self._cond:
                self._forget(digest, entry)
            if entry.path.exists():  # (a file the writer evicted meanwhile is a plain miss)
                self._drop_corrupt(entry.path, err)
            return None
        with self._cond:
            self._touch(entry)
            self.num_loaded += 1
        return stored

    def _read(self, digest: str, path: Path) -> tuple[dict[str, mx.array], dict[str, str]]:
        """The file's arrays: from its read-ahead when one was made, else read now."""
        early = self.read_ahead.take(digest)
        if early is None:
            return read_prefix_file(path)
        if early.error is not None:
            raise early.error
        return arrays_from_bytes(early.arrays), early.metadata

    def _drop_corrupt(self, path: Path, err: BaseException) -> None:
        log.warning("deleting corrupt prefix-cache file %s: %s", path.name, err)
        path.unlink(missing_ok=True)
        with self._cond:
            self.num_corrupt += 1

    # index (callers hold the lock, except during the scan)

    def _touch(self, entry: _Entry) -> None:
        newest = max((e.last_used for e in self._entries.values()), default=0.0)
        entry.last_used = max(time.time(), newest + 0.001)  # strictly newest, even within one clock tick
        with contextlib.suppress(OSError):
            os.utime(entry.path, (entry.last_used, entry.last_used))

    def _foreign_files(self) -> list[ForeignFile]:
        """The cache folder's files outside this tier's index, listed without holding its lock."""
        with self._cond:
            known = {entry.path for entry in self._entries.values()}
            known |= {self.folder / f"{digest}{SUFFIX}" for digest in self._writing}  # not indexed yet
        return foreign_files(self.folder.parent, known)

    def _make_room(self, incoming: int, foreign: list[ForeignFile]) -> None:
        """Delete the least recently used files, this tier's or `foreign` ones (disk_budget.py:
        other models', other processes'; those deleted leave the list), until the whole cache
        folder and `incoming` bytes fit the budget."""
        total = self.nbytes + sum(f.nbytes for f in foreign)
        while (self._entries or foreign) and total + incoming > self.budget_bytes:
            own = min(self._entries, key=lambda d: self._entries[d].last_used) if self._entries else None
            if own is None or (foreign and foreign[0].last_used < self._entries[own].last_used):
                gone = foreign.pop(0)
                gone.path.unlink(missing_ok=True)
                total -= gone.nbytes
            else:
                total -= self._entries[own].nbytes
                self._delete(own)

    def _add(self, digest: str, entry: _Entry) -> None:
        old = self._entries.pop(digest, None)
        if old is not None:
            self._nbytes -= old.nbytes
        self._entries[digest] = entry
        self._nbytes += entry.nbytes

    def _forget(self, digest: str, entry: _Entry) -> None:
        if self._entries.get(digest) is entry:
            del self._entries[digest]
            self._nbytes -= entry.nbytes

    def _delete(self, digest: str) -> None:
        entry = self._entries.pop(digest, None)
        if entry is not None:
            self._nbytes -= entry.nbytes
            entry.path.unlink(missing_ok=True)
