"""Process-wide settings an engine holds while it runs, and gives back when it stops.

MLX's buffer-cache limit and Python's GIL switch interval are one per process. Engines running
together hold the smallest of their values; the value from before the first comes back when the
last lets go, whatever order they close in (a change made meanwhile by someone else is undone).
Letting go twice (a stop, then the engine thread's end) is harmless.

The switch interval is how long a thread waiting for the GIL lets its holder run before asking for
it. The engine thread gives the GIL up whenever MLX waits on the device; while another thread of the
process runs Python (a request's chat template rendered, a large body parsed), the engine waits that
long to get it back, at every such wait of every step. Python's 5 ms default halves the demo's decode
beside one busy thread; 1 ms keeps most of it (lab/gil_neighbours.py).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

import mlx.core as mx


class ProcessBound:
    """A process-wide value that engines hold: the smallest held applies. `apply(value)` sets it and
    returns the value it replaced."""

    def __init__(self, apply: Callable[[float], float]) -> None:
        self._apply = apply
        self._lock = threading.Lock()
        self._held: dict[object, float] = {}
        self._outer: float = 0  # the process's value before the first hold

    def hold(self, holder: object, value: float) -> None:
        with self._lock:
            if not self._held:
                self._outer = self._apply(value)
            self._held[holder] = value
            self._apply(min(self._held.values()))

    def release(self, holder: object) -> None:
        with self._lock:
            if self._held.pop(holder, None) is None:
                return
            self._apply(min(self._held.values()) if self._held else self._outer)


def _swap_switch_interval(seconds: float) -> float:
    before = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    return before


BUFFER_CACHE = ProcessBound(mx.set_cache_limit)
GIL_SWITCH = ProcessBound(_swap_switch_interval)


class EngineHolds:
    """One engine's holds: its buffer-cache bound and its GIL switch interval, each unless None."""

    def __init__(self, cache_bytes: int | None, switch_interval_s: float | None) -> None:
        self.cache_bytes = cache_bytes
        self.switch_interval_s = switch_interval_s

    def take(self) -> None:
        if self.cache_bytes is not None:
            BUFFER_CACHE.hold(self, self.cache_bytes)
        if self.switch_interval_s is not None:
            GIL_SWITCH.hold(self, self.switch_interval_s)

    def release(self) -> None:
        BUFFER_CACHE.release(self)
        GIL_SWITCH.release(self)
