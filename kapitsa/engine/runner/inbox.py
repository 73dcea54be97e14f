"""What other threads send the engine thread, besides new sequences (its inbox, a queue)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(eq=False)
class Abort:
    request_id: str


@dataclass(eq=False)
class Prefetch:
    key_ids: Sequence[int]  # a prompt's ids, whose disk checkpoint is read ahead


@dataclass(eq=False)
class Stop:
    done: threading.Event = field(default_factory=threading.Event)  # set once the engine has stopped
