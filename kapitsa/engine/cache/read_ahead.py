"""Reading disk-tier checkpoints ahead of the request that needs them.

A conversation whose checkpoints memory pressure pushed to disk comes back with a request; the
client names the tokens it will resume from before it queues the request (`Engine.prefetch`), and a
background thread reads that file and checks its checksums meanwhile. The thread calls no MLX
function (MLX streams belong to the engine thread): it keeps the file's bytes, and the engine thread
turns them into arrays when the lookup asks for them (`take`), instead of reading the file then.

At most `max_bytes` of read-ahead buffers are held (the oldest untaken read goes first); a file
larger than that is left to the lookup.
"""

from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

from kapitsa.engine.cache.file import PreparedArray, read_prefix_bytes

log = logging.getLogger(__name__)

_IDLE_S = 30.0  # the reader thread ends after this long without work


@dataclass(slots=True, frozen=True)
class ReadFile:
    """A checkpoint file read and checked off the engine thread (or the reason it failed)."""

    arrays: list[PreparedArray]
    metadata: dict[str, str]
    nbytes: int
    error: Exception | None = None


class ReadAhead:
    """A queue of checkpoint files to read on a background thread.

    Args:
        max_bytes: the most that files queued, being read and read but not yet taken may hold
            (0: read nothing ahead).
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.num_read = 0  # files read ahead
        self.num_taken = 0  # of those, the ones a lookup used
        self._cond = threading.Condition()
        self._sizes: dict[str, int] = {}  # every digest queued, being read or ready -> its file's size
        self._queue: collections.deque[tuple[str, Path]] = collections.deque()
        self._reading: set[str] = set()
        self._ready: dict[str, ReadFile] = {}
        self._cancelled: set[str] = set()  # reads in progress that nobody will take
        self._thread: threading.Thread | None = None

    @property
    def buffered_bytes(self) -> int:
        with self._cond:
            return sum(self._sizes.values())

    def request(self, digest: str, path: Path, nbytes: int) -> bool:
        """Queue `path` (its file's size `nbytes`) to be read; False when it is known or does not fit."""
        with self._cond:
            if digest in self._cancelled:  # a read in progress that is wanted again
                self._cancelled.discard(digest)
                return True
            if digest in self._sizes or nbytes > self.max_bytes:
                return False
            while self._ready and sum(self._sizes.values()) + nbytes > self.max_bytes:
                self._forget(next(iter(self._ready)))  # the oldest read nobody took makes room
            if sum(self._sizes.values()) + nbytes > self.max_bytes:
                return False  # reads in flight fill the budget
            self._sizes[digest] = nbytes
            self._queue.append((digest, path))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="kapitsa-read-ahead", daemon=True)
                self._thread.start()
            self._cond.notify_all()
            return True

    def take(self, digest: str, timeout: float = 10.0) -> ReadFile | None:
        """The file read ahead for `digest`, waiting for a read in progress; None: not asked for."""
        with self._cond:
            self._cond.wait_for(lambda: digest in self._ready or digest not in self._sizes, timeout)
            found = self._ready.get(digest)
            if found is not None:
                self._forget(digest)
                self.num_taken += 1
            return found

    def discard(self, digest: str) -> None:
        """Drop the read of `digest` (queued, in progress or done): no lookup will take it."""
        with self._cond:
            if digest in self._reading:
                self._cancelled.add(digest)
            elif digest in self._sizes:
                self._queue = collections.deque(item for item in self._queue if item[0] != digest)
                self._forget(digest)

    def _forget(self, digest: str) -> None:
        self._ready.pop(digest, None)
        self._sizes.pop(digest, None)

    def _loop(self) -> None:
        while True:
            with self._cond:
                if not self._cond.wait_for(lambda: self._queue, _IDLE_S):
                    self._thread = None
                    return
                digest, path = self._queue.popleft()
                self._reading.add(digest)
            read = _read(path)
            with self._cond:
                self._reading.discard(digest)
                if digest in self._cancelled:
                    self._cancelled.discard(digest)
                    self._forget(digest)
                else:
                    self._ready[digest] = read
                    self.num_read += 1
                self._cond.notify_all()


def _read(path: Path) -> ReadFile:
    try:
        data = path.read_bytes()
        arrays, metadata = read_prefix_bytes(data)
        return ReadFile(arrays, metadata, len(data))
    except Exception as err:  # noqa: BLE001 - the lookup deletes or misses it, as if it read it;
        # anything uncaught would end this thread and leave every later take() waiting its timeout
        log.info("read-ahead of %s failed: %s", path.name, err)
        return ReadFile([], {}, 0, err)
