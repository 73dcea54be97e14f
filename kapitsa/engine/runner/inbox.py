"""What other threads send the engine thread, besides new sequences (its inbox, a queue)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from kapitsa.engine.types import ErrorEvent


@dataclass(eq=False)
class Abort:
    request_id: str


@dataclass(eq=False)
class Prefetch:
    key_ids: Sequence[int]  # a prompt's ids, whose disk checkpoint is read ahead


@dataclass(eq=False)
class Stop:
    done: threading.Event = field(default_factory=threading.Event)  # set once the engine has stopped


def fail_queued(inbox: queue.SimpleQueue, err: Exception) -> None:
    """Answer whatever still waits in a stopped engine's inbox: new sequences get `err`, a stop
    request is released."""
    while True:
        try:
            item = inbox.get_nowait()
        except queue.Empty:
            return
        if isinstance(item, Stop):
            item.done.set()
        elif not isinstance(item, (Abort, Prefetch)):  # a sequence (runner/sequence.py)
            item.emit(ErrorEvent(item.request_id, err))
