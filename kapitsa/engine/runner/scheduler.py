"""Who runs next: the waiting queue, sequences in prefill (round-robin by chunk) and the decode batch.

The scheduler only orders sequences; the engine owns their caches and the batch cache. The order of
`decoding` is the row order of the decode batch cache.
"""

from __future__ import annotations

from collections import deque

from kapitsa.engine.runner.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, *, max_running: int) -> None:
        if max_running < 1:
            raise ValueError("max_running must be >= 1")
        self.max_running = max_running
        self.waiting: deque[Sequence] = deque()
        self.prefilling: deque[Sequence] = deque()
        self.decoding: list[Sequence] = []

    @property
    def num_running(self) -> int:
        return len(self.prefilling) + len(self.decoding)

    @property
    def has_running(self) -> bool:
        return bool(self.prefilling or self.decoding)

    @property
    def has_free_slot(self) -> bool:
        return self.num_running < self.max_running

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def admit(self, seq: Sequence) -> None:
        """Move a waiting sequence into prefill."""
        self.waiting.remove(seq)
        seq.status = SequenceStatus.PREFILLING
        self.prefilling.append(seq)

    def add_fork(self, seq: Sequence) -> None:
        """A choice forked from a sequence whose prefill just ended: it starts where that one stands."""
        seq.status = SequenceStatus.PREFILLING
        self.prefilling.append(seq)

    def send_back(self, seqs: list[Sequence]) -> None:
        """Sequences (decoding, prefilling or queued) go to the front of the queue, in their order,
        ahead of new ones."""
        for seq in reversed(seqs):
            self.remove(seq)
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)

    def next_prefill(self) -> Sequence | None:
        """The sequence whose prompt gets the next chunk (rotating, so short prompts are not stuck
        behind a long one)."""
        if not self.prefilling:
            return None
        seq = self.prefilling[0]
        self.prefilling.rotate(-1)
        return seq

    def start_decoding(self, seq: Sequence) -> int:
        """Move a prefilled sequence into the decode batch; returns its row."""
        self.prefilling.remove(seq)
        seq.status = SequenceStatus.DECODING
        self.decoding.append(seq)
        return len(self.decoding) - 1

    def remove(self, seq: Sequence) -> int | None:
        """Take a sequence out wherever it is; returns its decode row if it had one."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.prefilling:
            self.prefilling.remove(seq)
        elif seq in self.decoding:
            row = self.decoding.index(seq)
            del self.decoding[row]
            return row
        return None

    def find(self, request_id: str) -> Sequence | None:
        found = self.find_all(request_id)
        return found[0] if found else None

    def find_all(self, request_id: str) -> list[Sequence]:
        """Every sequence of a request (its n choices)."""
        return [seq for seq in self.all() if seq.request_id == request_id]

    def all(self) -> list[Sequence]:
        return [*self.waiting, *self.prefilling, *self.decoding]
