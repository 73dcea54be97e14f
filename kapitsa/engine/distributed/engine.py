"""`GroupEngine`: the `EngineClient` rank 0 serves while the other ranks follow its steps.

One request at a time, batch 1: each prompt chunk and each decode step is broadcast (control.py)
and run on every rank's shard; rank 0 samples from the logits its shard returns. With speculation
(speculation.py) a decode step verifies rank 0's n-gram draft: the group runs `[last, d1..dk]`
recorded, rank 0 accepts from every position's logits, and the next command tells every rank how
many of those tokens to roll back. A lost or silent
peer fails the running and queued requests with `PeerLost`, then ends the process after
`EXIT_GRACE_S` (time for the error to reach the client): the group cannot serve without it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
import time
from collections.abc import AsyncIterator

from kapitsa.engine.cache.hybrid import HybridCache
from kapitsa.engine.distributed.control import Command, Op, broadcast
from kapitsa.engine.distributed.group import HEARTBEAT_S, PeerLost, hard_exit
from kapitsa.engine.distributed.loading import LoadedShard
from kapitsa.engine.distributed.speculation import GroupSpeculation
from kapitsa.engine.distributed.watchdog import StepClock, Watchdog
from kapitsa.engine.runner.memory import check_context
from kapitsa.engine.runner.output import emit_tokens, threadsafe_put
from kapitsa.engine.runner.sampler import SampledToken, SequenceSampler
from kapitsa.engine.runner.sequence import Sequence
from kapitsa.engine.runner.stop import StopMatcher
from kapitsa.engine.text.prepare import prepare_prompt
from kapitsa.engine.text.prompt_encoder import PromptEncoder
from kapitsa.engine.text.token_checks import check_request_token_ids
from kapitsa.engine.types import (
    EngineStats,
    ErrorEvent,
    Event,
    FinishEvent,
    GenerationRequest,
    ModelInfo,
    Usage,
)
from kapitsa.errors import EngineDead, InvalidRequest

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
    """

    def __init__(
        self,
        shard,  # noqa: ANN001
        loaded: LoadedShard,
        *,
        clock: StepClock | None = None,
        speculation: GroupSpeculation | None = None,
    ) -> None:
        assert loaded.tokenizer is not None and loaded.info is not None
        self.shard, self.tokenizer = shard, loaded.tokenizer
        self.speculation = speculation
        self._drop = 0  # tokens of the last verify every rank rolls back before the next forward
        self._cache: HybridCache | None = None
        self.info = dataclasses.replace(loaded.info, vocab_size=loaded.model.args.vocab_size)
        self.encoder = PromptEncoder(self.tokenizer)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids)
        self.alive, self.error = True, None
        self._current: Sequence | None = None
        self._aborted: set[str] = set()
        self._counts = {"finished": 0, "failed": 0, "generated": 0, "computed": 0}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._clock = clock or StepClock()
        self._watchdog = Watchdog(self._silent)
        self._thread = threading.Thread(target=self._run, name="kapitsa-group", daemon=True)
        self._thread.start()

    # EngineClient

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Event]:
        seq = await asyncio.to_thread(self._make_sequence, request)
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
            prompt_tokens_computed=c["computed"],
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

    # requests

    def _make_sequence(self, request: GenerationRequest) -> Sequence:
        if request.n != 1 or request.sampling.constraint is not None:
            raise InvalidRequest("a distributed model serves one choice per request, without a grammar")
        prepared = prepare_prompt(self.tokenizer, request, encode=self.encoder.encode)
        if not prepared.ids:
            raise InvalidRequest("the prompt is empty")
        check_request_token_ids(request, prepared.ids, self.info.vocab_size)
        check_context(len(prepared.ids), self.info.context_length)
        room = self.info.context_length - len(prepared.ids)
        wanted = request.sampling.max_tokens
        max_tokens = min(room, self.info.max_output_tokens if wanted is None else wanted)
        return Sequence(
            request=request,
            prompt_ids=prepared.ids,
            emit=lambda _event: None,
            sampler=None,  # made on the engine thread (it holds MLX arrays)
            detokenizer=self.tokenizer.detokenizer(),
            stop=StopMatcher(request.sampling.stop),
            max_tokens=max(1, max_tokens),
            eos_ids=self.eos_token_ids,
            token_text=lambda token_id: self.tokenizer.decode([token_id]),
        )

    # the engine thread

    def _run(self) -> None:
        try:
            while True:
                try:
                    item = self._inbox.get(timeout=HEARTBEAT_S)
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
        prompt = seq.prompt_ids
        for start in range(0, len(prompt), PREFILL_CHUNK):
            logits = self._forward(prompt[start : start + PREFILL_CHUNK], new_cache=start == 0)
            if seq.request_id in self._aborted:
                return self._finish(seq, "abort", started, started)
        self._counts["computed"] += len(prompt)
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

    def _decode_step(self, seq: Sequence) -> list[SampledToken]:
        """One forward after `seq`'s last token: a verify of a draft when there is one, else plain."""
        spec, last = self.speculation, seq.output_ids[-1]
        draft = [] if spec is None else spec.propose(seq)
        logits = self._forward([last, *draft], new_cache=False, record=bool(draft))
        if draft:
            tokens, self._drop = spec.accept(seq, draft, logits)
            return tokens
        if spec is not None:
            spec.count(1)
        return [seq.sampler.sample(logits)]

    def _finish(self, seq: Sequence, reason: str, started: float, prefilled: float) -> None:
        self._aborted.discard(seq.request_id)
        usage = Usage(
            prompt_tokens=seq.num_prompt_tokens,
            completion_tokens=len(seq.output_ids),
            prefill_seconds=prefilled - started,
            decode_seconds=time.perf_counter() - prefilled,
        )
        seq.emit(FinishEvent(seq.request_id, reason, usage, stop_sequence=seq.stop_sequence))

    def _forward(self, tokens: list[int], *, new_cache: bool, record: bool = False):  # noqa: ANN202 - mx.array
        """Every rank's forward of `tokens`; rank 0's logits (`[T, V]` when `record`, else `[V]`)."""
        command = Command(Op.FORWARD, tuple(tokens), new_cache, record, 0 if new_cache else self._drop)
        self._drop = 0
        self._send(command)
        self._cache = self.shard.cache_for(self._cache, command)
        self._watchdog.arm("a forward", self._clock.deadline(command.paced_as, command.warm_key))
        started = time.perf_counter()
        try:
            logits = self.shard.step(self._cache, tokens, record)
        finally:
            self._watchdog.disarm()
        self._clock.record(command.paced_as, time.perf_counter() - started, command.warm_key)
        return logits

    def _send(self, command: Command) -> None:
        self._watchdog.arm("a control broadcast", self._clock.deadline(1))
        try:
            broadcast(self.shard.group, command)
        finally:
            self._watchdog.disarm()

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
