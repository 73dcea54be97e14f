"""What other threads send the engine thread, besides new sequences (its inbox, a queue)."""

from __future__ import annotations

import queue
from collections.abc import Sequence
from dataclasses import dataclass

from kapitsa.engine.types import ErrorEvent


@dataclass(eq=False)
class Abort:
    request_id: str


@dataclass(eq=False)
class Prefetch:
    key_ids: Sequence[int]  # a prompt's ids, whose disk checkpoint is read ahead


@dataclass(eq=False)
class Stop:
    """Stop the engine: the closer waits for the thread to let go of it (runner/loop.py)."""


def fail_queued(inbox: queue.SimpleQueue, err: Exception) -> None:
    """Answer whatever still waits in a stopped engine's inbox: new sequences get `err`."""
    while True:
        try:
            item = inbox.get_nowait()
        except queue.Empty:
            return
        if not isinstance(item, (Abort, Prefetch, Stop)):  # a sequence (runner/sequence.py)
            item.emit(ErrorEvent(item.request_id, err))
