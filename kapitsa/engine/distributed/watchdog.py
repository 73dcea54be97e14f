"""Deadlines for blocking steps: a collective waiting on a peer that is gone never returns.

`StepClock` says how long a step may take: `factor` times the median recent step of its kind (a
decode step, or a prefill chunk per token), at least `floor_s`; `first_s` until one of its kind
has finished (the first steps trace and warm up), and for the first step of each speculative
shape (`warm_key`: a verify's width and a rollback's length each compile their own kernels on a
GPU, seconds on a large model). `Watchdog` calls its callback once an armed
section outlives its deadline.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable

FIRST_STEP_S = 60.0  # no step of this kind has finished yet: loading, tracing, a long first chunk
FLOOR_S = 3.0
FACTOR = 8.0  # a healthy step seldom takes 8x its median; a dead peer's never ends


class StepClock:
    def __init__(
        self,
        *,
        first_s: float = FIRST_STEP_S,
        floor_s: float = FLOOR_S,
        factor: float = FACTOR,
        window: int = 32,
    ) -> None:
        self.first_s, self.floor_s, self.factor = first_s, floor_s, factor
        self._decode: deque[float] = deque(maxlen=window)  # seconds per decode step
        self._chunk: deque[float] = deque(maxlen=window)  # seconds per token of a prefill chunk
        self._warm: set[object] = set()  # the speculative shapes that ran once

    def deadline(self, tokens: int, warm_key: object = None) -> float:
        recent = self._decode if tokens == 1 else self._chunk
        if not recent or (warm_key is not None and warm_key not in self._warm):
            return self.first_s
        return max(self.floor_s, self.factor * statistics.median(recent) * (1 if tokens == 1 else tokens))

    def record(self, tokens: int, seconds: float, warm_key: object = None) -> None:
        if warm_key is not None:
            self._warm.add(warm_key)
        if tokens == 1:
            self._decode.append(seconds)
        else:
            self._chunk.append(seconds / tokens)


class Watchdog:
    """Calls `on_timeout(what)` once an armed section outlives its deadline; checks 10 times a second."""

    def __init__(self, on_timeout: Callable[[str], None]) -> None:
        self._on_timeout = on_timeout
        self._lock = threading.Lock()
        self._armed: tuple[float, str] | None = None
        self._thread = threading.Thread(target=self._watch, name="kapitsa-watchdog", daemon=True)
        self._thread.start()

    def arm(self, what: str, timeout_s: float) -> None:
        with self._lock:
            self._armed = (time.monotonic() + timeout_s, f"{what}, {timeout_s:.0f} s")

    def disarm(self) -> None:
        with self._lock:
            self._armed = None

    def _watch(self) -> None:
        while True:
            time.sleep(0.1)
            with self._lock:
                armed = self._armed
            if armed is not None and time.monotonic() > armed[0]:
                self._on_timeout(armed[1])
                return
