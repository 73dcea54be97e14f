"""Rank 0's steps: prefill chunks of one request interleaved with decode steps of the batch.

Each call to `step` runs at most one prompt chunk of the request being prefilled, then one decode
step for every decoding request (as the single engine's loop does), so a long prompt stalls the
running streams by at most one chunk. A prefilled request joins the batch at the next command; a
finished one leaves it there, after every rank saved its final state from a copy of its row. A
decode step of one row verifies an n-gram draft when there is one (speculation.py); a step of
several rows feeds one token per row.
"""

from __future__ import annotations

import time

from kapitsa.engine.distributed.control import MAX_ROWS, Command, Op, Pending, broadcast
from kapitsa.engine.distributed.prefix import GroupPrefix
from kapitsa.engine.distributed.speculation import GroupSpeculation
from kapitsa.engine.distributed.watchdog import StepClock, Watchdog
from kapitsa.engine.runner.output import emit_tokens, usage_of
from kapitsa.engine.runner.sampler import SampledToken, SequenceSampler
from kapitsa.engine.runner.sequence import Sequence
from kapitsa.engine.types import FinishEvent

PREFILL_CHUNK = 512
MAX_BATCH = min(16, MAX_ROWS)


class Driver:
    """Rank 0's running requests and the commands that advance them.

    Args:
        shard: rank 0's `Shard`; its `caches` follow every command sent.
        prefix: the index of saved states.
        speculation: n-gram drafting for a sequence decoding alone; None for plain steps.
        clock, watchdog: the deadline of each blocking step and the watch that enforces it.
        aborted: request ids whose clients left (shared with the engine).
    """

    def __init__(
        self,
        shard,  # noqa: ANN001
        prefix: GroupPrefix,
        *,
        speculation: GroupSpeculation | None,
        clock: StepClock,
        watchdog: Watchdog,
        aborted: set[str],
    ) -> None:
        self.shard, self.prefix, self.speculation = shard, prefix, speculation
        self.clock, self.watchdog, self.aborted = clock, watchdog, aborted
        self.pending = Pending()  # bookkeeping the next command carries
        self.rows: list[Sequence] = []  # the batch's rows, in the order every rank holds them
        self.prefilling: Sequence | None = None
        self.counts = {"finished": 0, "failed": 0, "generated": 0, "computed": 0, "cached": 0}
        self.saved_bytes = 0
        self._restore = 0  # the saved state the prefilling request's first chunk starts from
        self._last_forward = (0, False)  # its token count, and whether it was recorded (a verify)

    @property
    def can_start(self) -> bool:
        return self.prefilling is None and len(self.rows) < MAX_BATCH

    def start(self, seq: Sequence, eos_ids: tuple[int, ...]) -> None:
        """`seq` is prefilled next, from the deepest state saved for its prefix."""
        seq.sampler = SequenceSampler(seq.request.sampling, seq.prompt_ids, eos_ids)
        seq.prefill_started = time.perf_counter()
        self._restore, seq.num_cached_tokens = self.prefix.lookup(seq.key_ids)
        seq.num_processed = seq.num_cached_tokens
        self.counts["cached"] += seq.num_cached_tokens
        self.prefilling = seq
        if self.speculation is not None:
            self.speculation.start(seq)

    def step(self) -> None:
        if self.prefilling is not None:
            self._prefill_chunk(self.prefilling)
        if self.rows:
            self._decode()

    def idle(self) -> None:
        self.send(Command(Op.IDLE))

    # prefill

    def _prefill_chunk(self, seq: Sequence) -> None:
        if seq.request_id in self.aborted:
            self.prefilling = None
            return self._finish(seq, "abort", row=0)
        start, end = seq.num_processed, seq.next_chunk_end(PREFILL_CHUNK)
        first = start == seq.num_cached_tokens
        logits = self._forward(
            [seq.prompt_ids[start:end]], new_cache=first, restore=self._restore if first else 0
        )
        seq.num_processed = end
        self.counts["computed"] += end - start
        if (boundary := seq.boundary_at(end)) is not None:
            self.pending.save_next(self.prefix.add(seq.key_ids[:end], boundary.kind))
        if end < seq.num_prompt_tokens:
            return None
        self.prefilling, seq.prefill_done_at = None, time.perf_counter()
        if (reason := self._emit(seq, [seq.sampler.sample(logits[0])])) is not None:
            return self._finish(seq, reason, row=0)
        self.pending.join = True  # the next command moves its cache into the batch, as the last row
        self.rows.append(seq)
        return None

    # decode

    def _decode(self) -> None:
        rows, spec = self.rows, self.speculation
        if len(rows) == 1 and spec is not None:
            tokens = [self._verify_or_step(rows[0], spec)]
        else:
            logits = self._forward([[seq.output_ids[-1]] for seq in rows], batch=True)
            tokens = [[seq.sampler.sample(logits[i])] for i, seq in enumerate(rows)]
            if spec is not None:
                spec.count(len(rows), rows=len(rows))
        finished = []
        for row, (seq, sampled) in enumerate(zip(rows, tokens, strict=True)):
            if (reason := self._emit(seq, sampled)) is not None:
                finished.append((row, seq, reason))
        if finished:
            self._leave(finished)

    def _verify_or_step(self, seq: Sequence, spec: GroupSpeculation) -> list[SampledToken]:
        """One forward after `seq`'s last token: a verify of a draft when there is one, else plain."""
        draft = spec.propose(seq)
        logits = self._forward([[seq.output_ids[-1], *draft]], batch=True, record=bool(draft))
        if draft:
            tokens, self.pending.drop = spec.accept(seq, draft, logits)
            return tokens
        spec.count(1)
        return [seq.sampler.sample(logits[0])]

    def _emit(self, seq: Sequence, tokens: list[SampledToken]) -> str | None:
        """Stream `tokens`; why `seq` ends, or None while it goes on."""
        before = len(seq.output_ids)
        reason = emit_tokens(seq, tokens)
        self.counts["generated"] += len(seq.output_ids) - before
        if reason is None and seq.request_id in self.aborted:
            reason = "abort"
        return reason

    def _leave(self, finished: list[tuple[int, Sequence, str]]) -> None:
        """Finish these rows (each saved before any leaves); they leave at the next command."""
        gone = {row for row, _, _ in finished}
        self.rows = [seq for row, seq in enumerate(self.rows) if row not in gone]
        for row, seq, reason in finished:
            self._finish(seq, reason, row=row + 1)
        self.pending.leave |= sum(1 << row for row in gone)

    def _finish(self, seq: Sequence, reason: str, *, row: int) -> None:
        """End `seq` (`row`: 0 the prefill cache holds it, r + 1 batch row r)."""
        self.aborted.discard(seq.request_id)
        if reason != "abort":
            self._save_final(seq, row)
        if self.speculation is not None:
            self.speculation.finish(seq)
        self.counts["finished"] += 1
        seq.finished_at = time.perf_counter()
        seq.emit(FinishEvent(seq.request_id, reason, usage_of(seq), stop_sequence=seq.stop_sequence))

    def _save_final(self, seq: Sequence, row: int) -> None:
        """Have every rank keep the state at the end of the request (its ids but the last, which no
        forward took): an agent's next turn extends it. A verify whose accepted tokens ran past
        the end (a stop string, max_tokens) rolls back those too. Sent at once: the row may leave
        at the next command."""
        caches = self.shard.caches
        held = (caches.prefill if row == 0 else caches.batch).offsets[max(0, row - 1)]
        held -= self.pending.drop if row else 0
        tokens = seq.all_key_ids[:-1]
        extra = held - len(tokens)
        width, recorded = self._last_forward
        if extra < 0 or (extra and not (row and recorded and self.pending.drop + extra <= width)):
            return
        state_id = self.prefix.add(tokens, "final")
        if not state_id:
            return
        if self.pending.save:  # a prompt boundary's save goes first
            self.idle()
        self.pending.drop += extra
        self.pending.save_next(state_id, row)
        self.idle()

    # commands

    def _forward(
        self,
        rows: list[list[int]],
        *,
        new_cache: bool = False,
        restore: int = 0,
        record: bool = False,
        batch: bool = False,
    ):  # noqa: ANN202 - mx.array
        """Every rank's forward of `rows` (batch: one token per decoding row; else one sequence's
        tokens); rank 0's logits (`[T, V]` when `record`, else `[B, V]`)."""
        tokens = [row[0] for row in rows] if batch and not record else rows[0]
        command = Command(Op.FORWARD, tuple(tokens), new_cache, record, restore=restore, batch=batch)
        command = self.send(command)
        self._last_forward = (len(tokens), record)
        self.watchdog.arm("a forward", self.clock.deadline(command.paced_as, command.warm_key))
        started = time.perf_counter()
        try:
            logits = self.shard.step(self.shard.caches.target(command), command.rows, record)
        finally:
            self.watchdog.disarm()
        self.clock.record(command.paced_as, time.perf_counter() - started, command.warm_key)
        return logits

    def send(self, command: Command) -> Command:
        """Broadcast `command` with the pending bookkeeping, and apply that here; what was sent."""
        command = self.pending.stamp(command)
        self.watchdog.arm("a control broadcast", self.clock.deadline(1))
        try:
            broadcast(self.shard.group, command)
        finally:
            self.watchdog.disarm()
        self.shard.caches.apply(command)
        if command.save:
            self.pending.forgets.extend(self.prefix.victims())
        if command.save or command.forget:
            self.saved_bytes = self.shard.saved.nbytes()
        return command
