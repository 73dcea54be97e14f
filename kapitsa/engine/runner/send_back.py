"""A batch that runs out of memory: its rows go back to the queue instead of failing.

A decode step of several rows can run the device out of memory (the rows together, or memory another
process took meanwhile). That step is lost, not the requests: each row goes back to the front of the
queue with what it has streamed, keeps its sampler and its place, and its next prefill runs over its
prompt and output so far, after which it decodes on. The engine then runs at most half as many
sequences at once for `HOLD_S`, so the retry fits. A prefill chunk that runs out of memory beside
other sequences sends its own sequence back the same way (`restartable`): one with no output yet
starts its prompt over. Either starts from the prefix cache's deepest checkpoint of what it feeds:
a failed step empties the cache's memory into its disk tier (serve keeps one), where the
checkpoints its chunks wrote stay. A request sent back `MAX_SEND_BACKS` times, one that ran alone,
and those `resumable` and `restartable` turn down fail as before (`memory.AloneFailures`).
"""

from __future__ import annotations

import logging
import time

from kapitsa.engine.runner.memory import MemoryBudget
from kapitsa.engine.runner.sequence import MESSAGE_KINDS, Sequence

log = logging.getLogger(__name__)

MAX_SEND_BACKS = 3
HOLD_S = 120.0  # how long a halved limit stays after the last out-of-memory batch step


class BatchLimit:
    """How many sequences run at once: the configured number, halved for `hold_s` seconds after
    each out-of-memory batch step (down to one)."""

    def __init__(self, configured: int, *, hold_s: float = HOLD_S) -> None:
        self.configured, self.hold_s = configured, hold_s
        self.limit, self.until = configured, 0.0

    def after_failure(self, rows: int, now: float) -> int:
        self.limit = max(1, min(self.limit, rows) // 2)
        self.until = now + self.hold_s
        return self.limit

    def current(self, now: float) -> int:
        if self.limit < self.configured and now >= self.until:
            self.limit = self.configured
        return self.limit


def resumable(seq: Sequence) -> bool:
    """Whether a row of a failed batch can resume: not sent back too often, without images (their
    positions cover the prompt only), and with a sampler that has read back no pick the failed step
    left out of its output (a row of a synchronous or speculative step that the failure cut short
    would resume with a grammar or penalties ahead of its output)."""
    in_step = seq.sampler is not None and seq.sampler.observed != len(seq.output_ids)
    return seq.times_sent_back < MAX_SEND_BACKS and seq.media is None and not in_step


def restartable(seq: Sequence) -> bool:
    """Whether a sequence whose prefill chunk failed can go back to the queue: its prefill has not
    reached the step that samples its first token (and forks its other choices), and it is not
    sent back too often; one resuming a failed batch's row also as `resumable` says."""
    if seq.times_sent_back >= MAX_SEND_BACKS or seq.num_processed >= len(seq.feed_ids):
        return False
    return resumable(seq) if seq.resuming else True


def prepare_restart(seq: Sequence, memory: MemoryBudget) -> None:
    """A sequence whose first prefill failed (it has no output) starts that prefill over from the
    queue: it drops its cache, sampler and reservation, and the checkpoint boundaries its start
    planned beside its messages' (the new start plans them again); admission and
    `prefill_start.start` make the rest again, from the prefix cache's deepest checkpoint."""
    seq.sampler = None
    seq.boundaries = [b for b in seq.boundaries if b.kind in MESSAGE_KINDS]
    _drop_step_state(seq, memory)


def prepare_resume(seq: Sequence, memory: MemoryBudget) -> None:
    """A sequence taken out of a failed batch keeps its output, sampler and stop state; it drops its
    cache and its reservation (admission reserves again) and is marked to resume."""
    if seq.sampler is not None:
        seq.sampler.forget_queued(seq.prompt_ids, seq.output_ids)
    seq.resuming = True
    _drop_step_state(seq, memory)


def _drop_step_state(seq: Sequence, memory: MemoryBudget) -> None:
    """What a sequence sent back gives up either way: its cache and reservation (admission reserves
    again), its place in its prefill; and its wait for memory starts again."""
    seq.cache = seq.prompt_tail = seq.pending_logits = None
    memory.release(seq.reserved_bytes)
    seq.reserved_bytes = 0
    seq.num_processed = 0
    seq.arrival = time.perf_counter()  # (`queue_timeout_s`)
    seq.times_sent_back += 1


def log_send_back(sent: int, running: int, limit: int, failure: str) -> None:
    log.warning(
        "a step of %d sequences ran out of memory (%s): %d back to the queue, at most %d running "
        "at once for %.0f s",
        running,
        failure[:200],
        sent,
        limit,
        HOLD_S,
    )
