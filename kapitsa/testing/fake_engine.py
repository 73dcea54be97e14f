"""`FakeEngine`: a scripted `EngineClient` for server, TUI, launcher and agent tests.

Replies are queued with `enqueue` and consumed in order; with none queued it echoes a fixed text.
Token ids are the UTF-8 bytes of the text, so counts are deterministic and easy to reason about.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

from kapitsa.engine.types import (
    EngineStats,
    ErrorEvent,
    Event,
    FinishEvent,
    FinishReason,
    GenerationRequest,
    ModelInfo,
    PrefillProgressEvent,
    TokenEvent,
    TokenLogprob,
    Usage,
)

DEFAULT_REPLY = "Hello from the fake engine."


@dataclass(slots=True, frozen=True)
class ScriptedReply:
    chunks: tuple[str, ...]
    finish_reason: FinishReason = "stop"
    error: Exception | None = None
    delay_s: float = 0.0  # pause before each chunk (lets tests disconnect mid-stream)
    cached_tokens: int = 0
    prefill_s: float = 0.0  # simulated prompt processing time, reported as PrefillProgressEvents


Responder = Callable[[GenerationRequest], "str | list[str] | None"]
"""Computes a reply from the request when nothing is queued (None = use the default reply)."""


class FakeEngine:
    """An `EngineClient` that plays back scripted replies."""

    def __init__(
        self,
        *,
        model: ModelInfo | None = None,
        default_reply: str = DEFAULT_REPLY,
        responder: Responder | None = None,
    ) -> None:
        self.model = model or ModelInfo(
            id="fake", family="fake", context_length=32768, max_output_tokens=8192, tool_call_format="hermes"
        )
        self.default_reply = default_reply
        self.responder = responder
        self.requests: list[GenerationRequest] = []  # every request seen, in order
        self._script: deque[ScriptedReply] = deque()
        self._active: dict[str, asyncio.Event] = {}
        self._finished = 0
        self._generated = 0
        self.alive = True

    def enqueue(
        self,
        text: str | list[str],
        *,
        finish_reason: FinishReason = "stop",
        delay_s: float = 0.0,
        cached_tokens: int = 0,
        prefill_s: float = 0.0,
    ) -> None:
        """Queue one reply; a list streams as those chunks, a string as one chunk per word."""
        chunks = tuple(text) if isinstance(text, list) else _split_words(text)
        self._script.append(ScriptedReply(chunks, finish_reason, None, delay_s, cached_tokens, prefill_s))

    def enqueue_error(self, error: Exception) -> None:
        self._script.append(ScriptedReply((), "error", error))

    def _next_reply(self, request: GenerationRequest) -> ScriptedReply:
        if self._script:
            return self._script.popleft()
        text = self.responder(request) if self.responder is not None else None
        if text is not None:
            return ScriptedReply(tuple(text) if isinstance(text, list) else _split_words(text))
        return ScriptedReply(_split_words(self.default_reply))

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Event]:
        """The next scripted reply; with n > 1, one reply per choice, their events interleaved."""
        self.requests.append(request)
        self._active[request.request_id] = aborted = asyncio.Event()
        players = [self._play(request, aborted) for _ in range(request.n)]
        try:
            live = list(enumerate(players))
            while live:
                for index, player in list(live):
                    event = await anext(player, None)
                    if event is None:
                        live.remove((index, player))
                    elif isinstance(event, ErrorEvent):
                        yield event
                        return
                    elif index == 0 or not isinstance(event, PrefillProgressEvent):
                        yield replace(event, index=index) if index else event
        finally:
            for player in players:
                await player.aclose()
            self._active.pop(request.request_id, None)
            self._finished += 1

    async def _play(self, request: GenerationRequest, aborted: asyncio.Event) -> AsyncIterator[Event]:
        reply = self._next_reply(request)
        prompt_tokens = await self.count_tokens(request)
        started = time.perf_counter()
        emitted: list[int] = []
        if reply.error is not None:
            yield ErrorEvent(request.request_id, reply.error)
            return
        finish: FinishReason = reply.finish_reason
        cached = min(reply.cached_tokens, prompt_tokens)
        yield PrefillProgressEvent(request.request_id, cached, prompt_tokens, cached_tokens=cached)
        async for progress in _prefill(request.request_id, prompt_tokens, reply.prefill_s, aborted):
            yield progress
        limit = request.sampling.max_tokens
        for chunk in _apply_stop(reply.chunks, request.sampling.stop):
            if reply.delay_s:
                await asyncio.sleep(reply.delay_s)
            else:
                await asyncio.sleep(0)
            if aborted.is_set():
                finish = "abort"
                break
            ids = tuple(chunk.encode())
            if limit is not None and len(emitted) + len(ids) > limit:
                ids = ids[: limit - len(emitted)]
                chunk = bytes(ids).decode(errors="ignore")
                finish = "length"
            emitted.extend(ids)
            self._generated += len(ids)
            yield TokenEvent(request.request_id, ids, chunk, _fake_logprobs(ids, request.sampling.logprobs))
            if finish == "length":
                break
        usage = Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=len(emitted),
            cached_tokens=cached,
            decode_seconds=time.perf_counter() - started,
        )
        stop_hit = _stop_hit(reply.chunks, request.sampling.stop)
        if stop_hit and finish == "stop":
            yield FinishEvent(request.request_id, "stop", usage, stop_sequence=stop_hit)
        else:
            yield FinishEvent(request.request_id, finish, usage)

    async def abort(self, request_id: str) -> None:
        event = self._active.get(request_id)
        if event is not None:
            event.set()

    async def count_tokens(self, request: GenerationRequest) -> int:
        return len(_render(request).encode())

    def stats(self) -> EngineStats:
        return EngineStats(
            alive=self.alive,
            model=self.model.id,
            active_requests=len(self._active),
            generated_tokens=self._generated,
            requests_finished=self._finished,
        )

    def models(self) -> list[ModelInfo]:
        return [self.model]

    def with_model(self, **changes: object) -> FakeEngine:
        self.model = replace(self.model, **changes)  # type: ignore[arg-type]
        return self


async def _prefill(
    request_id: str, prompt_tokens: int, seconds: float, aborted: asyncio.Event
) -> AsyncIterator[PrefillProgressEvent]:
    """Sleep `seconds` in ten steps, reporting progress after each (stops early when aborted)."""
    if seconds <= 0:
        return
    for step in range(1, 11):
        await asyncio.sleep(seconds / 10)
        if aborted.is_set():
            return
        yield PrefillProgressEvent(request_id, prompt_tokens * step // 10, prompt_tokens)


def _fake_logprobs(ids: tuple[int, ...], top: int | None) -> tuple[TokenLogprob, ...] | None:
    """Deterministic logprobs when asked for: each byte token at -0.5, alternatives one id up, -1.5, -2.5, ..."""
    if top is None:
        return None
    return tuple(
        TokenLogprob(
            i,
            bytes([i]).decode(errors="replace"),
            -0.5,
            tuple(
                ((i + k) % 256, bytes([(i + k) % 256]).decode(errors="replace"), -0.5 - k)
                for k in range(1, top + 1)
            ),
        )
        for i in ids
    )


def _split_words(text: str) -> tuple[str, ...]:
    words = text.split(" ")
    return tuple(w if i == len(words) - 1 else w + " " for i, w in enumerate(words)) if text else ()


def _render(request: GenerationRequest) -> str:
    if request.prompt is not None:
        return request.prompt
    if request.prompt_token_ids is not None:
        return "x" * len(request.prompt_token_ids)
    return json.dumps([request.messages, request.tools], sort_keys=True, default=str)


def _stop_hit(chunks: tuple[str, ...], stops: tuple[str, ...]) -> str | None:
    text = "".join(chunks)
    hits = [(text.find(s), s) for s in stops if s and s in text]
    return min(hits)[1] if hits else None


def _apply_stop(chunks: tuple[str, ...], stops: tuple[str, ...]) -> tuple[str, ...]:
    """Cut the scripted text at the first stop string, as the real engine does."""
    hit = _stop_hit(chunks, stops)
    if hit is None:
        return chunks
    cut = "".join(chunks).find(hit)
    out, pos = [], 0
    for chunk in chunks:
        if pos + len(chunk) >= cut:
            if cut > pos:
                out.append(chunk[: cut - pos])
            break
        out.append(chunk)
        pos += len(chunk)
    return tuple(out)
