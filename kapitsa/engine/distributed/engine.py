"""`GroupEngine`: the `EngineClient` rank 0 serves while the other ranks follow its steps.

One request at a time, batch 1: each prompt chunk and each decode step is broadcast (control.py)
and run on every rank's shard; rank 0 samples from the logits its shard returns. A prompt starts
from the deepest state saved for its prefix (prefix.py: rank 0's index; saved.py: every rank's
states), and every rank saves the state at the prompt's message boundaries and at the end of the
request, so an agent's next turn computes only its new tokens. With speculation (speculation.py)
a decode step verifies rank 0's n-gram draft: the group runs `[last, d1..dk]` recorded, rank 0
accepts from every position's logits, and the next command tells every rank how many of those
tokens to roll back. A lost or silent peer fails the running and queued requests with
`PeerLost`, then ends the process after `EXIT_GRACE_S` (time for the error to reach the client):
the group cannot serve without it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
import time
from collections.abc import AsyncIterator

from kapitsa.engine.cache.hybrid import HybridCache
from kapitsa.engine.distributed.control import Command, Op, Pending, broadcast
from kapitsa.engine.distributed.group import HEARTBEAT_S, PeerLost, hard_exit
from kapitsa.engine.distributed.loading import LoadedShard
from kapitsa.engine.distributed.prefix import GroupPrefix, default_budget
from kapitsa.engine.distributed.requests import make_sequence
from kapitsa.engine.distributed.speculation import GroupSpeculation
from kapitsa.engine.distributed.watchdog import StepClock, Watchdog
from kapitsa.engine.runner.output import emit_tokens, threadsafe_put
from kapitsa.engine.runner.sampler import SampledToken, SequenceSampler
from kapitsa.engine.runner.sequence import Sequence
from kapitsa.engine.text.prepare import prepare_prompt
from kapitsa.engine.text.prompt_encoder import PromptEncoder
from kapitsa.engine.types import (
    EngineStats,
    ErrorEvent,
    Event,
    FinishEvent,
    GenerationRequest,
    ModelInfo,
    Usage,
)
from kapitsa.errors import EngineDead

EXIT_GRACE_S = 1.0
PREFILL_CHUNK = 512
_STOP = object()


class GroupEngine:
    """An `EngineClient` over a process group; rank 0 only.

    Args:
        shard: rank 0's `Shard` (shard.py / tensor.py).
        loaded: what `load_shard` returned on rank 0 (tokenizer, info).
        clock: how long a step may block before the group is declared dead (watchdog.py).
        speculation: rank 0's drafting and acceptance; None decodes one token per step.
        prefix_cache_bytes: what rank 0's saved states may hold (0: no prefix cache; None: a
            quarter of the memory left next to its weights).
    """

    def __init__(
        self,
        shard,  # noqa: ANN001
        loaded: LoadedShard,
        *,
        clock: StepClock | None = None,
        speculation: GroupSpeculation | None = None,
        prefix_cache_bytes: int | None = None,
    ) -> None:
        assert loaded.tokenizer is not None and loaded.info is not None
        self.shard, self.tokenizer = shard, loaded.tokenizer
        self.speculation = speculation
        self._pending = Pending()  # drop, save and forget for the next command to carry
        self._cache: HybridCache | None = None
        self._last_forward = (0, False)  # its token count, and whether it was recorded (a verify)
        budget = default_budget() if prefix_cache_bytes is None else prefix_cache_bytes
        self.prefix = GroupPrefix(shard.saved, budget)
        self._saved_bytes = 0
        self.info = dataclasses.replace(loaded.info, vocab_size=loaded.model.args.vocab_size)
        self.encoder = PromptEncoder(self.tokenizer)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids)
        self.alive, self.error = True, None
        self._current: Sequence | None = None
        self._aborted: set[str] = set()
        self._counts = {"finished": 0, "failed": 0, "generated": 0, "computed": 0, "cached": 0}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._clock = clock or StepClock()
        self._watchdog = Watchdog(self._silent)
        self._thread = threading.Thread(target=self._run, name="kapitsa-group", daemon=True)
        self._thread.start()

    # EngineClient

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Event]:
        seq = await asyncio.to_thread(
            make_sequence, request, tokenizer=self.tokenizer, encoder=self.encoder, info=self.info
        )
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        seq.emit = threadsafe_put(loop, events)
        if not self.alive:
            yield ErrorEvent(request.request_id, self.error or EngineDead("the group has stopped"))
            return
        self._inbox.put(seq)
        if not self.alive:  # lost between the check and the put: nobody will answer
            yield ErrorEvent(request.request_id, self.error or EngineDead("the group has stopped"))
            return
        done = False
        try:
            while not done:
                event = await events.get()
                done = isinstance(event, (FinishEvent, ErrorEvent))
                yield event
        finally:
            if not done:
                self._aborted.add(request.request_id)

    async def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)

    async def count_tokens(self, request: GenerationRequest) -> int:
        prepared = await asyncio.to_thread(
            prepare_prompt, self.tokenizer, request, encode=self.encoder.encode
        )
        return len(prepared.ids)

    def stats(self) -> EngineStats:
        c, spec = self._counts, self.speculation
        return EngineStats(
            speculative="none" if spec is None else spec.name,
            draft_acceptance_rate=0.0 if spec is None else spec.acceptance_rate,
            tokens_per_step=0.0 if spec is None else spec.tokens_per_step,
            alive=self.alive,
            model=self.info.id,
            active_requests=int(self._current is not None),
            batch_size=int(self._current is not None),
            prompt_tokens_cached=c["cached"],
            prompt_tokens_computed=c["computed"],
            checkpoints_in_memory=len(self.prefix),
            checkpoint_bytes_in_memory=self._saved_bytes,
            generated_tokens=c["generated"],
            requests_finished=c["finished"],
            requests_failed=c["failed"],
        )

    def models(self) -> list[ModelInfo]:
        return [self.info]

    def close(self) -> None:
        """Stop the followers (they return from `follow`) and the engine thread."""
        if self.alive:
            self._inbox.put(_STOP)
            self._thread.join(timeout=30)

    # the engine thread

    def _run(self) -> None:
        try:
            while True:
                try:
                    item = self._inbox.get(timeout=0 if self._pending.any else HEARTBEAT_S)
                except queue.Empty:
                    self._send(Command(Op.IDLE))
                    continue
                if item is _STOP:
                    self._send(Command(Op.STOP))
                    self.alive = False
                    return
                self._serve(item)
        except PeerLost as err:
            self._lost(err)
        except Exception as err:  # noqa: BLE001 - a step that failed half-way leaves the ranks out of step
            self._lost(PeerLost(f"the group's engine failed: {err!r}"))

    def _serve(self, seq: Sequence) -> None:
        self._current = seq  # kept on a PeerLost: `_lost` fails it
        seq.sampler = SequenceSampler(seq.request.sampling, seq.prompt_ids, tuple(self.eos_token_ids))
        if self.speculation is not None:
            self.speculation.start()
        self._generate(seq)
        self._counts["finished"] += 1
        self._current = None

    def _generate(self, seq: Sequence) -> None:
        started = time.perf_counter()
        logits = self._prefill(seq)
        if logits is None:
            return self._finish(seq, "abort", started, started)
        prefilled = time.perf_counter()
        tokens = [seq.sampler.sample(logits)]
        while True:
            before = len(seq.output_ids)
            reason = emit_tokens(seq, tokens)
            self._counts["generated"] += len(seq.output_ids) - before
            if reason is None and seq.request_id in self._aborted:
                reason = "abort"
            if reason is not None:
                return self._finish(seq, reason, started, prefilled)
            tokens = self._decode_step(seq)

    def _prefill(self, seq: Sequence):  # noqa: ANN202 - mx.array | None
        """Every rank's prefill of what no saved state holds; the last logits, None when aborted."""
        restore, seq.num_cached_tokens = self.prefix.lookup(seq.key_ids)
        seq.num_processed = seq.num_cached_tokens
        self._counts["cached"] += seq.num_cached_tokens
        logits, new_cache = None, True
        while seq.num_processed < seq.num_prompt_tokens:
            start, end = seq.num_processed, seq.next_chunk_end(PREFILL_CHUNK)
            logits = self._forward(seq.prompt_ids[start:end], new_cache=new_cache, restore=restore)
            new_cache, seq.num_processed = False, end
            self._counts["computed"] += end - start
            if (boundary := seq.boundary_at(end)) is not None:
                self._pending.save_next(self.prefix.add(seq.key_ids[:end], boundary.kind))
            if seq.request_id in self._aborted:
                return None
        return logits

    def _decode_step(self, seq: Sequence) -> list[SampledToken]:
        """One forward after `seq`'s last token: a verify of a draft when there is one, else plain."""
        spec, last = self.speculation, seq.output_ids[-1]
        draft = [] if spec is None else spec.propose(seq)
        logits = self._forward([last, *draft], record=bool(draft))
        if draft:
            tokens, self._pending.drop = spec.accept(seq, draft, logits)
            return tokens
        if spec is not None:
            spec.count(1)
        return [seq.sampler.sample(logits)]

    def _finish(self, seq: Sequence, reason: str, started: float, prefilled: float) -> None:
        self._aborted.discard(seq.request_id)
        if reason != "abort":
            self._save_final(seq)
        usage = Usage(
            prompt_tokens=seq.num_prompt_tokens,
            cached_tokens=seq.num_cached_tokens,
            completion_tokens=len(seq.output_ids),
            prefill_seconds=prefilled - started,
            decode_seconds=time.perf_counter() - prefilled,
        )
        seq.emit(FinishEvent(seq.request_id, reason, usage, stop_sequence=seq.stop_sequence))

    def _save_final(self, seq: Sequence) -> None:
        """Have every rank keep the state at the end of the request (its ids but the last, which no
        forward took): an agent's next turn extends it. A verify whose accepted tokens ran past
        the end (a stop string, max_tokens) rolls back those too."""
        held = self._cache.offsets[0] - self._pending.drop
        tokens = seq.all_key_ids[:-1]
        extra = held - len(tokens)
        width, recorded = self._last_forward
        if extra < 0 or (extra and not (recorded and self._pending.drop + extra <= width)):
            return
        self._pending.drop += extra
        self._pending.save_next(self.prefix.add(tokens, "final"))

    def _forward(self, tokens: list[int], *, new_cache: bool = False, restore: int = 0, record: bool = False):  # noqa: ANN202 - mx.array
        """Every rank's forward of `tokens`; rank 0's logits (`[T, V]` when `record`, else `[V]`).
        `new_cache`: a new request's first forward, from saved state `restore` (0: empty)."""
        command = Command(Op.FORWARD, tuple(tokens), new_cache, record, restore=restore)
        command = self._send(command)
        self._last_forward = (len(tokens), record)
        self._watchdog.arm("a forward", self._clock.deadline(command.paced_as, command.warm_key))
        started = time.perf_counter()
        try:
            logits = self.shard.step(self._cache, tokens, record)
        finally:
            self._watchdog.disarm()
        self._clock.record(command.paced_as, time.perf_counter() - started, command.warm_key)
        return logits

    def _send(self, command: Command) -> Command:
        """Broadcast `command` with the pending bookkeeping, and apply that here; what was sent."""
        command = self._pending.stamp(command)
        self._watchdog.arm("a control broadcast", self._clock.deadline(1))
        try:
            broadcast(self.shard.group, command)
        finally:
            self._watchdog.disarm()
        self._cache = self.shard.cache_for(self._cache, command)
        if command.save:
            self._pending.forgets.extend(self.prefix.victims())
        if command.save or command.forget:
            self._saved_bytes = self.shard.saved.nbytes()
        return command

    # a lost group

    def _silent(self, what: str) -> None:
        self._lost(PeerLost(f"a rank of the group stopped: it has not answered in time ({what})"))

    def _lost(self, err: PeerLost) -> None:
        """Fail what runs and waits, then leave once the errors had time to reach their clients."""
        self.alive, self.error = False, err
        failed = [s for s in (self._current,) if s is not None]
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Sequence):
                failed.append(item)
        for seq in failed:
            seq.emit(ErrorEvent(seq.request_id, err))
        self._counts["failed"] += len(failed)
        timer = threading.Timer(EXIT_GRACE_S, hard_exit, args=(f"rank 0: {err}; stopping the group",))
        timer.daemon = True
        timer.start()
