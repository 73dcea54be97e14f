"""`GroupEngine`: the `EngineClient` rank 0 serves while the other ranks follow its steps.

Requests share decode steps (continuous batching, driver.py): rank 0 prefills one request at a
time, a chunk per step, between decode steps of the batch of every decoding request; each chunk
and step is broadcast (control.py) and run on every rank's shard, and rank 0 samples from the
logits its shard returns. A prompt starts from the deepest state saved for its prefix (prefix.py:
rank 0's index; saved.py: every rank's states), and every rank saves the state at the prompt's
message boundaries and at the end of the request, so an agent's next turn computes only its new
tokens. With speculation (speculation.py) a request decoding alone verifies rank 0's n-gram
drafts. A lost or silent peer fails the running and queued requests with `PeerLost`, then ends
the process after `EXIT_GRACE_S` (time for the error to reach the client): the group cannot
serve without it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
from collections import deque
from collections.abc import AsyncIterator

from kapitsa.engine.distributed.control import Command, Op
from kapitsa.engine.distributed.driver import Driver
from kapitsa.engine.distributed.group import HEARTBEAT_S, PeerLost, hard_exit
from kapitsa.engine.distributed.loading import LoadedShard
from kapitsa.engine.distributed.prefix import GroupPrefix, default_budget
from kapitsa.engine.distributed.requests import make_sequence
from kapitsa.engine.distributed.speculation import GroupSpeculation
from kapitsa.engine.distributed.watchdog import StepClock, Watchdog
from kapitsa.engine.options import EngineConfig
from kapitsa.engine.runner.output import threadsafe_put
from kapitsa.engine.runner.process_settings import EngineHolds
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
)
from kapitsa.errors import EngineDead

EXIT_GRACE_S = 1.0
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
        budget = default_budget() if prefix_cache_bytes is None else prefix_cache_bytes
        self.prefix = GroupPrefix(shard.saved, budget)
        self.info = dataclasses.replace(loaded.info, vocab_size=loaded.model.args.vocab_size)
        self.encoder = PromptEncoder(self.tokenizer)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids)
        self.alive, self.error = True, None
        self._aborted: set[str] = set()
        self._waiting: deque[Sequence] = deque()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.driver = Driver(
            shard,
            self.prefix,
            speculation=speculation,
            clock=clock or StepClock(),
            watchdog=Watchdog(self._silent),
            aborted=self._aborted,
        )
        self._thread = threading.Thread(target=self._run, name="kapitsa-group", daemon=True)
        # the engine thread waits for the GIL from busy neighbours as briefly as a local engine's
        self._holds = EngineHolds(None, EngineConfig().gil_switch_interval_s)
        self._holds.take()
        try:
            self._thread.start()
        except BaseException:
            self._holds.release()
            raise

    @property
    def speculation(self) -> GroupSpeculation | None:
        return self.driver.speculation

    @speculation.setter
    def speculation(self, speculation: GroupSpeculation | None) -> None:
        self.driver.speculation = speculation

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
        c, spec, driver = self.driver.counts, self.speculation, self.driver
        return EngineStats(
            speculative="none" if spec is None else spec.name,
            draft_acceptance_rate=0.0 if spec is None else spec.acceptance_rate,
            speculative_verifies=0 if spec is None else spec.verifies,
            draft_tokens_proposed=0 if spec is None else spec.stats.proposed,
            draft_tokens_accepted=0 if spec is None else spec.stats.accepted,
            tokens_per_step=0.0 if spec is None else spec.tokens_per_step,
            alive=self.alive,
            model=self.info.id,
            active_requests=len(driver.rows) + (driver.prefilling is not None),
            queued_requests=len(self._waiting),
            batch_size=len(driver.rows),
            prompt_tokens_cached=c["cached"],
            prompt_tokens_computed=c["computed"],
            checkpoints_in_memory=len(self.prefix),
            checkpoint_bytes_in_memory=driver.saved_bytes,
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
            while self._next():
                if self._waiting and self.driver.can_start:
                    self.driver.start(self._waiting.popleft(), tuple(self.eos_token_ids))
                if self._busy:
                    self.driver.step()
        except PeerLost as err:
            self._lost(err)
        except Exception as err:  # noqa: BLE001 - a step that failed half-way leaves the ranks out of step
            self._lost(PeerLost(f"the group's engine failed: {err!r}"))
        finally:
            self._holds.release()

    @property
    def _busy(self) -> bool:
        return bool(self.driver.rows or self.driver.prefilling or self._waiting)

    def _next(self) -> bool:
        """Take what arrived (new requests, a stop); an IDLE heartbeat when there is nothing to run.
        False once the group is stopped."""
        while True:
            wait = 0 if self._busy or self.driver.pending.any else HEARTBEAT_S
            try:
                item = self._inbox.get(timeout=wait) if wait else self._inbox.get_nowait()
            except queue.Empty:
                if not self._busy:
                    self.driver.idle()
                return True
            if item is _STOP:
                self._stop()
                return False
            self._waiting.append(item)

    def _stop(self) -> None:
        self.driver.send(Command(Op.STOP))
        self.alive, self.error = False, EngineDead("the group has stopped")
        for seq in self._running():
            seq.emit(ErrorEvent(seq.request_id, self.error))

    def _running(self) -> list[Sequence]:
        """Every request the group holds: decoding, prefilling, waiting."""
        prefilling = [] if self.driver.prefilling is None else [self.driver.prefilling]
        return [*self.driver.rows, *prefilling, *self._waiting]

    # a lost group

    def _silent(self, what: str) -> None:
        self._lost(PeerLost(f"a rank of the group stopped: it has not answered in time ({what})"))

    def _lost(self, err: PeerLost) -> None:
        """Fail what runs and waits, then leave once the errors had time to reach their clients."""
        self.alive, self.error = False, err
        failed = self._running()
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Sequence):
                failed.append(item)
        for seq in failed:
            seq.emit(ErrorEvent(seq.request_id, err))
        self.driver.counts["failed"] += len(failed)
        timer = threading.Timer(EXIT_GRACE_S, hard_exit, args=(f"rank 0: {err}; stopping the group",))
        timer.daemon = True
        timer.start()
