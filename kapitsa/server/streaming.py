"""One generation seen from a route: engine events through a queue, keep-alives, and abort on disconnect.

The engine iterator runs in its own task and a watcher task waits for the client's `http.disconnect`, so a
client that goes away aborts the generation at once, even during a long prefill when nothing is written.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from kapitsa.engine.client import EngineClient
from kapitsa.engine.types import ErrorEvent, Event, FinishEvent, GenerationRequest, PrefillProgressEvent
from kapitsa.errors import KapitsaError

log = logging.getLogger("kapitsa.server")

Receive = Callable[[], Awaitable[Any]]
KEEPALIVE = None  # yielded by `GenerationRun.events` when nothing happened for `keepalive_s`


class ClientGone(Exception):
    """The client disconnected; the generation was aborted."""


class GenerationRun:
    def __init__(
        self, client: EngineClient, request: GenerationRequest, receive: Receive, *, keepalive_s: float
    ) -> None:
        self.client = client
        self.request = request
        self.keepalive_s = keepalive_s
        self._receive = receive
        self._queue: asyncio.Queue[Event | BaseException] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._peeked: list[Event] = []
        self.finished = False
        self.disconnected = False
        self._unfinished_choices = request.n  # the stream ends after n FinishEvents (or one ErrorEvent)

    async def start(self, *, first_event_wait_s: float) -> None:
        """Start generating; wait briefly for the first event so a request error can still become a 4xx.

        Raises the `KapitsaError` of an error that arrives within the wait.
        """
        self._tasks = [asyncio.create_task(self._produce()), asyncio.create_task(self._watch())]
        try:
            item = (
                await asyncio.wait_for(self._queue.get(), first_event_wait_s) if first_event_wait_s else None
            )
        except TimeoutError:
            return
        if isinstance(item, ClientGone):
            await self.close()
            raise item
        event = self._check(item)
        if isinstance(event, ErrorEvent) and isinstance(event.error, KapitsaError):
            await self.close()
            raise event.error
        self._peeked.append(event)

    async def prompt_report(self, wait_s: float) -> PrefillProgressEvent | None:
        """The engine's first event when it reports the prompt (its size and cached part), waiting up to
        `wait_s` for it; the event stays queued for `events`. None when the engine is slower or says
        nothing. Raises `ClientGone` when the client disconnected."""
        if not self._peeked:
            try:
                item = await asyncio.wait_for(self._queue.get(), wait_s)
            except TimeoutError:
                return None
            self._peeked.append(self._check(item))
        first = self._peeked[0]
        return first if isinstance(first, PrefillProgressEvent) else None

    async def events(self) -> AsyncIterator[Event | None]:
        """Engine events in order, `KEEPALIVE` after each quiet `keepalive_s`; ends after the final event.

        Raises `ClientGone` when the client disconnected.
        """
        while self._peeked:
            event = self._peeked.pop(0)
            yield event
            if self._is_final(event):
                return
        while True:
            try:
                item = await self._next_item()
            except TimeoutError:
                yield KEEPALIVE
                continue
            event = self._check(item)
            yield event
            if self._is_final(event):
                return

    async def _next_item(self) -> Event | BaseException:
        """The next queued item, or TimeoutError after a quiet `keepalive_s`. A queued item is taken at
        once and a wait needs no task of its own: this runs once per streamed token, on the event
        loop that shares the GIL with the engine thread."""
        if not self._queue.empty():
            return self._queue.get_nowait()
        async with asyncio.timeout(self.keepalive_s):
            return await self._queue.get()

    async def collect(self) -> tuple[list[Event], Event]:
        """All events of a non-streaming request: the token events and the final event."""
        tokens: list[Event] = []
        async for event in self.events():
            if event is None:
                continue
            if self._is_final(event):
                return tokens, event
            tokens.append(event)
        raise RuntimeError("generation ended without a final event")  # pragma: no cover

    async def close(self) -> None:
        """Abort if still running and stop both tasks. Safe to call more than once."""
        if not self.finished:
            self.finished = True
            with contextlib.suppress(Exception):
                await self.client.abort(self.request.request_id)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task

    def _check(self, item: Event | BaseException) -> Event:
        if isinstance(item, ClientGone):
            raise item
        if isinstance(item, BaseException):
            return ErrorEvent(
                self.request.request_id, item if isinstance(item, Exception) else RuntimeError(str(item))
            )
        return item

    def _is_final(self, event: Event) -> bool:
        if isinstance(event, FinishEvent):
            self._unfinished_choices -= 1
        if isinstance(event, ErrorEvent) or self._unfinished_choices <= 0:
            self.finished = True
            return True
        return False

    async def _produce(self) -> None:
        events = self.client.generate(self.request)
        try:
            async for event in events:
                self._queue.put_nowait(event)  # unbounded: never waits
        except Exception as exc:  # validation errors are raised by `generate`; others travel as events
            self._queue.put_nowait(exc)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():  # `close` stops this producer
                raise
            # a cancellation from inside the engine client ends the stream as an error rather than
            # leaving `events` to send keep-alives for a generation that is gone
            self._queue.put_nowait(RuntimeError("the generation was cancelled inside the engine"))
        finally:
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(BaseException):
                    await aclose()

    async def _watch(self) -> None:
        while True:
            message = await self._receive()
            if message.get("type") == "http.disconnect":
                self.disconnected = True
                log.info("client disconnected; aborting %s", self.request.request_id)
                if not self.finished:
                    with contextlib.suppress(Exception):
                        await self.client.abort(self.request.request_id)
                await self._queue.put(ClientGone())
                return
