"""`InProcessEngine`: the `EngineClient` over an engine thread in this process.

Requests are rendered and tokenized in a worker thread (never on the event loop, never on the
engine thread), checked against the context window before anything is queued, then handed to the
engine thread; its events come back through an asyncio queue per request. Before a chat request's
template renders, and again once it is tokenized, the engine is told which tokens it will resume
from, so a checkpoint on disk is read meanwhile (cache/turn_hints.py, cache/read_ahead.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import mlx.core as mx

from kapitsa.engine.cache.turn_hints import TurnHints
from kapitsa.engine.kernels import cuda_disk_cache
from kapitsa.engine.loading.loader import LoadedModel
from kapitsa.engine.options import EngineConfig
from kapitsa.engine.runner.decode import DecodeStrategy
from kapitsa.engine.runner.loop import Engine
from kapitsa.engine.runner.memory import check_context
from kapitsa.engine.runner.output import threadsafe_put
from kapitsa.engine.runner.sequence import Sequence
from kapitsa.engine.runner.stop import StopMatcher
from kapitsa.engine.stats import speculation_counts
from kapitsa.engine.text.prepare import prediction_ids, prepare_prompt
from kapitsa.engine.text.prompt_encoder import PromptEncoder
from kapitsa.engine.text.token_checks import check_request_token_ids, model_vocab_size
from kapitsa.engine.types import (
    Constraint,
    EngineStats,
    ErrorEvent,
    Event,
    FinishEvent,
    GenerationRequest,
    ModelInfo,
    Usage,
)
from kapitsa.errors import ContextOverflow, EngineDead, InvalidRequest

# prompts rendered and tokenized at once, as many as asyncio's default pool runs (made as needed)
PREPARE_THREADS = min(32, (os.cpu_count() or 1) + 4)


class InProcessEngine:
    """An `EngineClient` backed by an `Engine` thread.

    Args:
        model: a kapitsa model (models/base.py protocol).
        tokenizer: encodes prompts, renders chat templates, makes incremental detokenizers.
        info: what `models()` reports (id, context length, ...).
        eos_token_ids: tokens that end a generation.
        config: engine settings.
        decode: the decode strategy (plain, or a speculative decoder).
        images: expands image placeholders and preprocesses images (`LoadedModel.images`); None
            for a text-only model, which then refuses requests with images.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        info: ModelInfo,
        *,
        eos_token_ids: frozenset[int] | set[int] | tuple[int, ...] = (),
        config: EngineConfig | None = None,
        decode: DecodeStrategy | None = None,
        images: Any = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.images = images
        self.encoder = PromptEncoder(tokenizer)
        vocab_size = model_vocab_size(model) or info.vocab_size
        self.info = dataclasses.replace(info, vocab_size=vocab_size)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.engine = Engine(model, config, decode=decode)
        self._preparing: dict[str, bool] = {}  # request id -> aborted while its prompt was being prepared
        self._grammars: Any = None  # a GrammarCompiler, built at the first constrained request
        self._grammars_lock = threading.Lock()
        self._hints = TurnHints()
        # Prompts are rendered and tokenized off the event loop, in threads this engine owns and joins
        # at close: a pool's worker drops its last task (and the engine it names) only when next
        # scheduled, so a shared pool could keep a closed engine's model alive for a while
        self._prepare_name = f"kapitsa-prepare-{id(self):x}"
        self._prepare = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix=self._prepare_name)

    @classmethod
    def from_loaded(
        cls, loaded: LoadedModel, *, config: EngineConfig | None = None, decode: DecodeStrategy | None = None
    ) -> InProcessEngine:
        """An engine over a model from `load_model`; the disk tier is keyed by its path and quantization."""
        config = config or EngineConfig()
        if config.model_key == EngineConfig().model_key:
            key = f"{loaded.path.resolve()}|{loaded.info.quantization}|{loaded.info.id}"
            config = dataclasses.replace(config, model_key=key)
        return cls(
            loaded.model,
            loaded.tokenizer,
            loaded.info,
            eos_token_ids=loaded.tokenizer.eos_token_ids,
            config=config,
            decode=decode,
            images=loaded.images,
        )

    # EngineClient

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Event]:
        self._preparing[request.request_id] = False
        try:
            seq = await self._off_loop(self._make_sequence, request)
        except EngineDead as err:  # closed: answered as a closed engine answers a submission
            yield ErrorEvent(request.request_id, err)
            return
        finally:
            aborted_early = self._preparing.pop(request.request_id, False)
        if aborted_early:
            for index in range(request.n):
                usage = Usage(prompt_tokens=seq.num_prompt_tokens)
                yield FinishEvent(request.request_id, "abort", usage, index=index)
            return
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        for choice in (seq, *seq.forks):
            choice.emit = threadsafe_put(loop, events)
        try:
            self.engine.submit(seq)
        except EngineDead as err:
            yield ErrorEvent(request.request_id, err)
            return
        done, unfinished = False, request.n
        try:
            while not done:
                event = await events.get()
                unfinished -= isinstance(event, FinishEvent)
                done = unfinished == 0 or isinstance(event, ErrorEvent)
                yield event
        finally:
            if not done:
                self.engine.abort(request.request_id)
        if request.messages and isinstance(event, FinishEvent):
            self._hints.remember(request.messages, seq.all_key_ids)  # the engine thread is done with it

    async def abort(self, request_id: str) -> None:
        if request_id in self._preparing:  # still being rendered: the engine has not seen it yet
            self._preparing[request_id] = True
        self.engine.abort(request_id)

    async def count_tokens(self, request: GenerationRequest) -> int:
        render = functools.partial(prepare_prompt, encode=self.encoder.encode, images=self.images)
        prepared = await self._off_loop(render, self.tokenizer, request)
        return len(prepared.ids)

    def stats(self) -> EngineStats:
        e = self.engine
        s = e.stats
        prefix, disk = e.prefix, e.prefix.disk if e.prefix is not None else None
        return EngineStats(
            alive=e.alive,
            model=self.info.id,
            prefill_tok_s=s.prefill_tok_s,
            decode_tok_s=s.decode_tok_s,
            active_requests=e.scheduler.num_running,
            queued_requests=len(e.scheduler.waiting),
            batch_size=len(e.scheduler.decoding),
            prompt_tokens_cached=s.prompt_cached,
            prompt_tokens_computed=s.prompt_computed,
            generated_tokens=s.generated,
            checkpoints_in_memory=prefix.num_checkpoints if prefix is not None else 0,
            checkpoint_bytes_in_memory=prefix.nbytes if prefix is not None else 0,
            checkpoints_on_disk=len(disk) if disk is not None else 0,
            checkpoint_bytes_on_disk=disk.nbytes if disk is not None else 0,
            corrupt_checkpoints_deleted=disk.num_corrupt if disk is not None else 0,
            **_residency(prefix),
            memory_in_use_bytes=mx.get_active_memory(),
            memory_peak_bytes=mx.get_peak_memory(),
            memory_limit_bytes=e.memory.limit_bytes,
            speculative=getattr(e.decode_strategy, "name", "custom"),
            draft_acceptance_rate=getattr(e.decode_strategy, "acceptance_rate", 0.0),
            **speculation_counts(e.decode_strategy),
            tokens_per_step=getattr(e.decode_strategy, "tokens_per_step", s.tokens_per_step),
            requests_finished=s.finished,
            requests_failed=s.failed,
            requests_sent_back=s.sent_back,
            warm_batches_pending=e.warmup.num_pending,
            warmup_seconds=round(e.warmup.seconds, 3),
        )

    def models(self) -> list[ModelInfo]:
        return [self.info]

    def close(self) -> None:
        """Stop the engine thread (flushing the prefix cache to its disk tier) and the kernel
        compiles it queued that have not started."""
        self.engine.shutdown()
        cuda_disk_cache.cancel_queued()
        # preparations not started are dropped (their requests get EngineDead); from one of the
        # pool's own threads (a callback) it cannot wait for itself
        on_own_thread = threading.current_thread().name.startswith(f"{self._prepare_name}_")
        self._prepare.shutdown(wait=not on_own_thread, cancel_futures=True)

    async def _off_loop(self, work: Callable[..., Any], *args: Any) -> Any:
        """`work(*args)` in one of the engine's preparing threads; EngineDead once it is closed."""
        try:
            future = self._prepare.submit(work, *args)
        except RuntimeError as err:  # the pool is shut down: the engine was closed
            raise EngineDead("the engine has stopped") from err
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if future.cancelled() and task is not None and not task.cancelling():
                raise EngineDead("the engine has stopped") from None  # dropped by close, not our caller
            raise

    # helpers

    def _make_sequence(self, request: GenerationRequest) -> Sequence:
        hint = self._hints.recall(request.messages) if request.messages else None
        if hint is not None:
            self.engine.prefetch(hint)  # the conversation's last request and reply, before templating
        prepared = prepare_prompt(self.tokenizer, request, encode=self.encoder.encode, images=self.images)
        if not prepared.ids:
            raise InvalidRequest("the prompt is empty")
        key_ids = prepared.ids if prepared.media is None else prepared.media.key_ids(prepared.ids)
        self.engine.prefetch(key_ids)  # what it resumes from when the reply re-rendered differently
        check_request_token_ids(request, prepared.ids, self.info.vocab_size)
        if request.sampling.eos_decay is None and self.info.eos_decay is not None:
            sampling = dataclasses.replace(request.sampling, eos_decay=self.info.eos_decay)
            request = dataclasses.replace(request, sampling=sampling)
        params = request.sampling
        check_context(len(prepared.ids), self.info.context_length)
        max_tokens, reserve = self._output_limit(len(prepared.ids), params.max_tokens)
        nbytes = self.engine.memory.sequence_bytes(reserve) * request.n
        if not self.engine.memory.fits_ever(nbytes):
            raise ContextOverflow(
                len(prepared.ids), self.info.context_length, self.engine.memory.describe_shortfall(nbytes)
            )
        seq = self._new_sequence(request, prepared.ids, max_tokens=max_tokens, reserve=reserve)
        seq.boundaries = prepared.boundaries
        if request.prediction:
            info = self.info
            seq.prediction_ids = prediction_ids(
                self.tokenizer.encode,
                request.prediction,
                window=info.context_length,
                longest=info.max_token_bytes,
            )
        if prepared.media is not None:
            seq.media, seq.prompt_key_ids = prepared.media, key_ids
        seq.forks = [self._choice(seq, index) for index in range(1, request.n)]
        return seq

    def _new_sequence(
        self, request: GenerationRequest, prompt_ids: list[int], *, max_tokens: int, reserve: int
    ) -> Sequence:
        params = request.sampling
        constraint = self._make_constraint(params.constraint)
        return Sequence(
            constraint=constraint,
            request=request,
            prompt_ids=prompt_ids,
            emit=_drop,
            sampler=None,
            detokenizer=self.tokenizer.detokenizer(),
            stop=StopMatcher(params.stop),
            max_tokens=max_tokens,
            eos_ids=self.eos_token_ids,
            token_text=self._token_text,
            reserved_tokens=reserve,
        )

    def _choice(self, first: Sequence, index: int) -> Sequence:
        """Choice `index` of an n > 1 request: the first's prompt with its own seed (seed + index),
        detokenizer, stop matcher and grammar state; the engine forks it when the prefill ends."""
        params = first.request.sampling
        seed = None if params.seed is None else params.seed + index
        request = dataclasses.replace(first.request, sampling=dataclasses.replace(params, seed=seed))
        seq = self._new_sequence(
            request, first.prompt_ids, max_tokens=first.max_tokens, reserve=first.reserved_tokens
        )
        seq.choice_index = index
        seq.media, seq.prompt_key_ids = first.media, first.prompt_key_ids
        seq.prediction_ids = first.prediction_ids
        return seq

    def _output_limit(self, prompt_tokens: int, wanted: int | None) -> tuple[int, int]:
        """The output limit and the tokens to reserve. A `max_tokens` beyond the room the prompt leaves, in
        the window or in memory, is clamped to that room: agents ask for fixed budgets whatever the model."""
        context = self.info.context_length
        memory = self.engine.memory
        room = context - prompt_tokens
        if wanted is None:
            return min(room, self.info.max_output_tokens), memory.reserve_tokens(prompt_tokens, None, context)
        max_tokens = max(1, min(wanted, room, memory.tokens_that_fit() - prompt_tokens))
        return max_tokens, prompt_tokens + max_tokens

    def _make_constraint(self, constraint: Constraint | None) -> Any:
        """The per-sequence grammar state (compiled here, off the engine thread: a big schema takes ms)."""
        if constraint is None:
            return None
        with self._grammars_lock:
            if self._grammars is None:
                from kapitsa.engine.text.constraint import GrammarCompiler

                backend = getattr(self.tokenizer, "backend", None)
                if backend is None:
                    raise InvalidRequest("this model's tokenizer cannot constrain its output")
                self._grammars = GrammarCompiler(
                    backend, vocab_size=self.info.vocab_size or 0, eos_ids=self.eos_token_ids
                )
        return self._grammars.make(constraint)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


def _residency(prefix: Any) -> dict[str, int]:
    if prefix is None:
        return {}
    kept, disk = prefix.residency, prefix.disk
    out = {
        "conversations_in_memory": kept.conversations,
        "resident_conversations": kept.resident,
        "resident_bytes": kept.resident_bytes,
        "checkpoints_preloaded": prefix.num_preloaded,
    }
    if disk is not None:
        out |= {
            "checkpoints_loaded_from_disk": disk.num_loaded,
            "checkpoints_read_ahead": disk.read_ahead.num_taken,
        }
    return out


def _drop(_event: Event) -> None:
    return None
