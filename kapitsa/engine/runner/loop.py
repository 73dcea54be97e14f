"""The engine thread: the one thread that touches MLX.

Requests arrive on an inbox queue (`submit`, `abort`); each step the engine admits waiting requests
(memory permitting), runs one decode step for the whole decode batch, then one prefill chunk for one
prefilling sequence, so long prompts never stall running streams for more than a chunk. Every event
goes out through the sequence's own `emit` callback; errors travel as `ErrorEvent` values.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
import weakref
from collections.abc import Sequence as TokenIds

import mlx.core as mx

from kapitsa.engine.options import EngineConfig
from kapitsa.engine.runner import checkpoints, prefill_start
from kapitsa.engine.runner.batch import DecodeBatch, can_pipeline
from kapitsa.engine.runner.choices import fork_choices
from kapitsa.engine.runner.decode import DecodeStrategy, PlainDecode
from kapitsa.engine.runner.inbox import Abort, Prefetch, Stop, fail_queued
from kapitsa.engine.runner.memory import (
    AloneFailures,
    MemoryBudget,
    buffer_cache_limit,
    device_memory_limit,
    is_out_of_memory,
    periodic_checkpoint_interval,
)
from kapitsa.engine.runner.model_runner import ModelRunner
from kapitsa.engine.runner.output import emit_tokens, usage_of
from kapitsa.engine.runner.prefix_tier import make_prefix_cache, preload_one, read_ahead
from kapitsa.engine.runner.process_settings import EngineHolds
from kapitsa.engine.runner.prompt_tail import tail_for
from kapitsa.engine.runner.sampler import SampledToken
from kapitsa.engine.runner.scheduler import Scheduler
from kapitsa.engine.runner.send_back import (
    BatchLimit,
    log_send_back,
    prepare_restart,
    prepare_resume,
    restartable,
    resumable,
)
from kapitsa.engine.runner.sequence import Sequence, SequenceStatus
from kapitsa.engine.runner.warmup import BatchWarmup
from kapitsa.engine.stats import StatsCounter
from kapitsa.engine.types import ErrorEvent, FinishEvent, FinishReason, PrefillProgressEvent
from kapitsa.errors import EngineBusy, EngineDead

log = logging.getLogger(__name__)


class Engine:
    """Owns the model, caches and the engine thread. Use `EngineClient` (inprocess.py) from async code.

    Args:
        model: a kapitsa model (see models/base.py).
        config: engine settings.
        decode: how a decode step is made (plain, or a speculative decoder).
    """

    def __init__(
        self, model, config: EngineConfig | None = None, *, decode: DecodeStrategy | None = None
    ) -> None:  # noqa: ANN001
        self.config = config or EngineConfig()
        # MLX streams are per thread: anything still lazy in the model (a dtype cast, a fresh init)
        # must be computed here, on the building thread, before the engine thread touches it.
        mx.eval(model.parameters())
        self.runner = ModelRunner.for_config(model, self.config)
        self.decode_strategy = decode or PlainDecode()
        sizes = self.runner.state_sizes()
        limit = self.config.memory_limit_bytes or device_memory_limit()
        self.memory = MemoryBudget(
            sizes,
            limit_bytes=limit,
            weights_bytes=mx.get_active_memory(),
            prefill_chunk=self.config.prefill_chunk,
        )
        cache_bytes = self.config.buffer_cache_bytes
        cache_bound = buffer_cache_limit(limit) if cache_bytes is None else cache_bytes
        # this engine's holds on process-wide settings (not the engine itself: no cycle)
        self._holds = EngineHolds(cache_bound, self.config.gil_switch_interval_s)
        self.prefix = make_prefix_cache(self.config, self.memory, self.runner)
        self.checkpoint_interval = self.config.checkpoint_interval or periodic_checkpoint_interval(
            sizes.recurrent_bytes, sizes.kv_bytes_per_token
        )
        self.scheduler = Scheduler(max_running=self.config.max_running)
        self.batch_limit = BatchLimit(self.config.max_running)
        self.stats = StatsCounter()
        self.alone_failures = AloneFailures()
        self.batch = DecodeBatch()  # rows in scheduler.decoding order
        self._inbox: queue.SimpleQueue[Sequence | Abort | Prefetch | Stop] = queue.SimpleQueue()
        self.warmup = BatchWarmup.for_config(self.config, self.memory, self.prefix, self._inbox)
        self._let_go = threading.Event()  # the thread holds the engine no longer (it can be freed)
        self._thread = threading.Thread(
            target=_thread_main,
            args=(weakref.ref(self), self._let_go),
            name="kapitsa-engine",
            daemon=True,
        )
        self.alive = True
        self._holds.take()  # let go when the engine stops
        try:
            self._thread.start()
        except BaseException:
            self._holds.release()
            raise

    # --- API used from other threads ---------------------------------------------------

    def submit(self, seq: Sequence) -> None:
        if not self.alive:
            raise EngineDead("the engine has stopped")
        self._inbox.put(seq)
        if not self.alive:  # it died between the check and the put: nobody will answer
            self._fail_all(EngineDead("the engine has stopped"))

    def abort(self, request_id: str) -> None:
        self._inbox.put(Abort(request_id))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Finish nothing further; abort what runs, flush the prefix cache to disk, stop the thread;
        return once the thread holds the engine no longer, so dropping the last reference frees
        the model and its caches at once (a bench hands that memory to the servers it times next)."""
        if threading.current_thread() is self._thread:
            timeout = 0.0  # from the engine's own thread (a callback): it cannot wait for itself
        if not self.alive:
            self._let_go.wait(timeout)
            return
        self._inbox.put(Stop())
        # the thread lets go after any end of its loop: this Stop, an earlier one, a failure
        self._let_go.wait(timeout)

    def prefetch(self, key_ids: TokenIds[int]) -> None:
        """Have the disk-tier checkpoint a coming prompt resumes from read ahead, unless memory holds
        one as deep (any thread; the engine thread decides between steps: cache/read_ahead.py)."""
        if self.prefix is not None and self.prefix.disk is not None and self.config.prefetch:
            self._inbox.put(Prefetch(key_ids))

    # --- the thread ----------------------------------------------------------------------

    def _nothing_to_do(self) -> bool:
        """Idle, once idle preloads (runner/prefix_tier.py) and warm-ups (runner/warmup.py) are done."""
        if self.scheduler.has_running or self.scheduler.waiting:
            return False
        preloaded = self.config.prefetch and preload_one(self.prefix, self.memory)
        return not (preloaded or self.warmup.run_one(self.runner))

    def _run(self) -> None:
        try:
            while self._drain_inbox(block=self._nothing_to_do()):
                self._admit()
                if self.scheduler.has_running:
                    self._step()
                elif self.scheduler.waiting:
                    time.sleep(0.005)  # waiting on memory that a background release may free
        except Exception as err:  # noqa: BLE001 - the engine must report, not vanish
            log.exception("engine thread failed")
            self.alive = False
            self._fail_all(EngineDead(f"the engine stopped after an internal error: {err}"))
        finally:
            self.alive = False
            self._holds.release()  # before the thread lets go (the closer waits)

    def _drain_inbox(self, *, block: bool) -> bool:
        """Apply queued submissions and aborts; False once asked to stop."""
        while True:
            try:
                item = self._inbox.get(block=block, timeout=None if block else 0)
            except queue.Empty:
                return True
            block = False
            if isinstance(item, Stop):
                self._stop()
                return False
            if isinstance(item, Abort):
                self._abort(item.request_id)
            elif isinstance(item, Prefetch):
                read_ahead(self.prefix, item.key_ids)
            elif len(self.scheduler.waiting) >= self.config.max_queued:
                item.emit(
                    ErrorEvent(item.request_id, EngineBusy("too many requests are queued; retry later"))
                )
            else:
                self.scheduler.add(item)

    def _stop(self) -> None:
        for seq in self.scheduler.all():
            self._finish(seq, "abort")
        self.batch = DecodeBatch()
        mx.synchronize()  # no queued device work may outlive the engine
        self.alive = False
        if self.prefix is not None:
            try:
                self.prefix.flush_to_disk()
            except Exception:  # noqa: BLE001 - a failed flush only loses cache entries
                log.exception("could not flush the prefix cache to disk")

    # --- admission -------------------------------------------------------------------------

    def _admit(self) -> None:
        self.scheduler.max_running = self.batch_limit.current(time.perf_counter())
        for seq in list(self.scheduler.waiting):
            if not self.scheduler.has_free_slot:
                return
            nbytes = self.memory.sequence_bytes(seq.reserved_tokens) * (1 + len(seq.forks))
            if not self._make_room(nbytes):
                if time.perf_counter() - seq.arrival > self.config.queue_timeout_s:
                    self.scheduler.remove(seq)
                    seq.status = SequenceStatus.FINISHED
                    seq.emit(
                        ErrorEvent(
                            seq.request_id, EngineBusy("not enough memory for this request now; retry later")
                        )
                    )
                    self.stats.failed += 1
                return  # keep arrival order: later requests wait behind this one
            self.memory.reserve(nbytes)
            seq.reserved_bytes = nbytes
            self.scheduler.admit(seq)

    def _make_room(self, nbytes: int) -> bool:
        """Whether `nbytes` fit now, shrinking the prefix cache if that is what it takes."""
        cache_bytes = self.prefix.nbytes if self.prefix is not None else 0
        if self.memory.fits_now(nbytes, other_bytes=cache_bytes):
            return True
        if self.prefix is None:
            return False
        self.prefix.enforce_budget(max(0, self.memory.free_bytes - nbytes))
        return self.memory.fits_now(nbytes, other_bytes=self.prefix.nbytes)

    # --- one step ----------------------------------------------------------------------------

    def _step(self) -> None:
        running = self.scheduler.num_running  # before a failure below takes rows out
        alone, back = running == 1, []  # `back`: sent back to the queue
        # what failed, kept as text: the exception's frames hold the failed step's buffers
        out_of_memory, failure = False, ""
        if self.scheduler.decoding:
            try:
                self._decode_step()
            except Exception as err:  # noqa: BLE001 - fail the batch, keep serving
                out_of_memory, failure = is_out_of_memory(err), str(err)
                back += self._decode_failed(err, alone=alone)
        seq = self.scheduler.next_prefill()
        if seq is not None:
            try:
                self._prefill_chunk(seq)
            except Exception as err:  # noqa: BLE001
                oom = is_out_of_memory(err)
                out_of_memory = out_of_memory or oom
                if oom and not alone and restartable(seq):
                    back.append(seq)  # after the batch's rows, which had streamed already
                    failure = str(err)
                else:
                    log.exception("prefill failed")
                    self._fail(seq, err, alone=alone)
        if back:
            self._send_back(back, failure, running=running)
        if out_of_memory:  # the failed step's buffers are freed once its traceback is gone
            if self.prefix is not None:  # a retry gets the cache's memory too (spilled to a disk tier)
                self.prefix.enforce_budget(0)
            mx.clear_cache()  # what the failed step held goes back to the device

    def _decode_failed(self, err: Exception, *, alone: bool) -> list[Sequence]:
        """After a failed decode step: rows that finished in it leave; of an out-of-memory step that
        did not run alone, the `resumable` rows go to the queue and are returned (`_send_back`
        prepares them); the rest fail."""
        for seq in [s for s in self.scheduler.decoding if s.is_finished]:
            self.scheduler.remove(seq)  # finished in this step, before the failure
        seqs = list(self.scheduler.decoding)
        back = [s for s in seqs if resumable(s)] if is_out_of_memory(err) and not alone else []
        if len(back) < len(seqs):
            log.exception("decode step failed")
        self.scheduler.send_back(back)  # queued at once: were anything below to raise, `_fail_all` finds them
        for seq in seqs:
            if seq not in back:
                self._fail(seq, err, alone=alone)
        self.batch = DecodeBatch()
        return back

    def _prefill_chunk(self, seq: Sequence) -> None:
        if seq.cache is None:
            self._start_prefill(seq)
        start, n, feed = seq.num_processed, self.config.prefill_chunk, seq.feed_ids
        # K/V is positional: without fixed-size state a chunk checkpoints the boundaries inside it too
        end = seq.next_chunk_end(n) if self.runner.recurrent_layers else min(start + n, len(feed))
        inside, t0 = [b.pos for b in seq.boundaries if start < b.pos < end], time.perf_counter()
        if end > start:
            ids, ends = feed[start:end], [*inside, end]
            *marked, logits = self.runner.prefill_at(
                seq.cache, ids, ends, media=seq.media, start=start, tail=seq.prompt_tail
            )
        else:  # an exact prefix-cache hit that kept the next-token logits
            logits, marked = seq.pending_logits, []
        seq.pending_logits = None
        self.stats.add_prefill(end - start, time.perf_counter() - t0)
        seq.num_processed = end
        for pos, at in [*zip(inside, marked, strict=True), (end, logits)]:
            checkpoints.at_boundary(seq, pos, at, self.prefix, self.runner)
        if end < len(feed):
            if not seq.resuming:
                seq.emit(PrefillProgressEvent(seq.request_id, end, seq.num_prompt_tokens))
            return
        if not seq.resuming:
            seq.prefill_done_at = time.perf_counter()
            seq.last_checkpoint_pos = end
        choices, seq.resuming = ([seq] if seq.resuming else [seq, *self._fork(seq)]), False
        for choice in choices:
            self._accept(choice, [choice.sampler.sample(logits)])
            if choice.is_finished:
                checkpoints.at_end(choice, choice.cache, self.prefix, self.runner)
                choice.cache = None
            else:
                self._join_batch(choice)

    def _fork(self, seq: Sequence) -> list[Sequence]:
        forks = fork_choices(seq)
        for child in forks:
            self.scheduler.add_fork(child)
        return forks

    def _start_prefill(self, seq: Sequence) -> None:
        if seq.resuming:
            prefill_start.resume(seq, self.prefix, self.runner)
            return
        tail = tail_for(self.decode_strategy, seq.num_prompt_tokens)
        self.stats.prompt_cached += prefill_start.start(seq, self.prefix, self.runner, tail)
        checkpoints.plan_checkpoints(seq, self.prefix, self.runner, self.checkpoint_interval)
        seq.emit(
            PrefillProgressEvent(
                seq.request_id, seq.num_processed, seq.num_prompt_tokens, cached_tokens=seq.num_cached_tokens
            )
        )

    def _send_back(self, seqs: list[Sequence], failure: str, *, running: int) -> None:
        """`seqs` back to the front of the queue, in their order, after a step ran out of memory
        with `running` sequences; the engine then runs at most half as many at once for a while."""
        for seq in seqs:
            if seq.resuming or seq.output_ids:
                prepare_resume(seq, self.memory)
            else:  # a first prefill: it starts over
                prepare_restart(seq, self.memory)
        if hasattr(self.decode_strategy, "forget"):  # drafters' state may hold the failed step's arrays
            self.decode_strategy.forget(seqs)
        self.scheduler.send_back(seqs)
        self.stats.sent_back += len(seqs)
        self.scheduler.max_running = self.batch_limit.after_failure(running, time.perf_counter())
        log_send_back(len(seqs), running, self.scheduler.max_running, failure)

    def _join_batch(self, seq: Sequence) -> None:
        self.scheduler.start_decoding(seq)
        self.batch.join(seq.cache, seq.output_ids[-1])
        seq.cache = None

    def _decode_step(self) -> None:
        seqs = list(self.scheduler.decoding)
        assert self.batch.size == len(seqs)
        for seq in seqs:
            self._grow_reservation(seq)
        samplers = [seq.sampler for seq in seqs]
        t0 = time.perf_counter()
        if self._pipeline_now(seqs) and can_pipeline(samplers):
            last = [seq.output_ids[-1] for seq in seqs]
            picks = [[] if t is None else [t] for t in self.batch.pipelined_step(self.runner, samplers, last)]
        elif self.batch.in_flight:  # a sequence that needs synchronous sampling joined: drain first
            picks = [[] if t is None else [t] for t in self.batch.flush(samplers)]
        else:
            assert self.batch.cache is not None
            picks = self.decode_strategy.step(self.runner, self.batch.cache, seqs)
        self.stats.add_decode(sum(len(p) for p in picks), time.perf_counter() - t0, len(seqs))
        for row, (seq, tokens) in enumerate(zip(seqs, picks, strict=True)):
            if tokens and not seq.is_finished:
                self._accept(seq, tokens)
                checkpoints.in_output(
                    seq, row, self.batch, self.prefix, self.runner, self.checkpoint_interval
                )
        self._leave_batch([i for i, s in enumerate(seqs) if s.is_finished], checkpoint=True)

    def _pipeline_now(self, seqs: list[Sequence]) -> bool:
        """Plain decoding pipelines always; a speculative strategy while its drafts are resting."""
        wants = getattr(self.decode_strategy, "wants_pipeline", None)
        if wants is not None:
            return wants(seqs)
        return getattr(self.decode_strategy, "pipelined", False)

    def _grow_reservation(self, seq: Sequence) -> None:
        """A request without max_tokens may outgrow its reservation while memory lasts."""
        if seq.num_tokens + 1 <= seq.reserved_tokens:
            return
        more = self.memory.sequence_bytes(seq.reserved_tokens + 1024) - seq.reserved_bytes
        if self._make_room(more):
            self.memory.reserve(more)
            seq.reserved_bytes += more
            seq.reserved_tokens += 1024
        else:
            seq.max_tokens = len(seq.output_ids)  # ends with finish_reason "length" on this step

    def _leave_batch(self, rows: list[int], *, checkpoint: bool) -> None:
        if not rows:
            return
        seqs = list(self.scheduler.decoding)
        for row in rows:
            if checkpoint:
                checkpoints.at_end(seqs[row], self.batch.extract(row), self.prefix, self.runner)
        for row in rows:
            self.scheduler.remove(seqs[row])
        self.batch.leave(rows)

    # --- output ----------------------------------------------------------------------------

    def _accept(self, seq: Sequence, tokens: list[SampledToken]) -> None:
        reason = emit_tokens(seq, tokens)
        self.stats.generated += len(tokens)
        if reason is not None:
            self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.WAITING:
            self.scheduler.remove(seq)
        elif seq.status is SequenceStatus.PREFILLING and reason == "abort":
            self.scheduler.remove(seq)
            seq.cache = None
        elif seq.status is SequenceStatus.PREFILLING:
            self.scheduler.prefilling.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.prompt_tail = reason, None  # a tail no drafter took goes with it
        seq.finished_at = time.perf_counter()
        self.memory.release(seq.reserved_bytes)
        seq.reserved_bytes = 0
        self.stats.finished += 1
        if reason != "abort":
            self.alone_failures.note_finished(seq.prompt_key_ids or seq.prompt_ids)
        seq.emit(
            FinishEvent(
                seq.request_id, reason, usage_of(seq), stop_sequence=seq.stop_sequence, index=seq.choice_index
            )
        )
        for child in seq.forks:  # choices that never started end with the sequence they would fork from
            child.status, child.finish_reason = SequenceStatus.FINISHED, reason
            child.finished_at = seq.finished_at
            child.emit(FinishEvent(child.request_id, reason, usage_of(child), index=child.choice_index))
        seq.forks = []

    def _abort(self, request_id: str) -> None:
        for seq in self.scheduler.find_all(request_id):
            if seq.status is SequenceStatus.DECODING:
                row = self.scheduler.decoding.index(seq)
                self._finish(seq, "abort")
                self._leave_batch([row], checkpoint=False)
            else:
                self._finish(seq, "abort")

    def _fail(self, seq: Sequence, err: Exception, *, alone: bool = False) -> None:
        if seq.is_finished:
            return
        error = self.alone_failures.error_for(
            err, seq.prompt_key_ids or seq.prompt_ids, processed=seq.num_processed, alone=alone
        )
        self.scheduler.remove(seq)
        seq.cache = seq.prompt_tail = None
        seq.status = SequenceStatus.FINISHED
        self.memory.release(seq.reserved_bytes)
        seq.reserved_bytes = 0
        self.stats.failed += 1
        seq.emit(ErrorEvent(seq.request_id, error))

    def _fail_all(self, err: Exception) -> None:
        for seq in self.scheduler.all():
            self._fail(seq, err)
        self.batch = DecodeBatch()
        fail_queued(self._inbox, err)


def _thread_main(engine_ref: weakref.ref[Engine], let_go: threading.Event) -> None:
    engine = engine_ref()
    try:
        if engine is not None:
            engine._run()
    except BaseException as err:  # noqa: BLE001 - SystemExit and the like: answer, let go, park
        log.exception("engine thread stopped")
        with contextlib.suppress(Exception):
            engine._fail_all(EngineDead(f"the engine thread stopped: {err!r}"))
    del engine  # only the weak reference stays: a stopped engine can be freed
    let_go.set()
    # Park rather than return: a finishing thread runs MLX's thread-local destructors (its compile
    # cache), which take the GIL; if the interpreter is exiting at that moment, the process aborts.
    threading.Event().wait()
