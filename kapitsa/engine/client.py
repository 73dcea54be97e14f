"""`EngineClient`: the one interface the server, TUI, bench and launchers use to reach an engine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol, runtime_checkable

from kapitsa.engine.types import EngineStats, Event, GenerationRequest, ModelInfo


@runtime_checkable
class EngineClient(Protocol):
    """An engine seen from the outside. Implementations: the in-process engine thread and `FakeEngine`.

    Errors during a generation arrive as an `ErrorEvent` (never a raised exception from the iterator),
    except request validation errors, which `generate` raises as `KapitsaError` before yielding.
    """

    def generate(self, request: GenerationRequest) -> AsyncIterator[Event]:
        """Start a generation and stream its events.

        Args:
            request: what to generate. Its `request_id` names it for `abort`.
        Returns:
            An async iterator of `TokenEvent`/`PrefillProgressEvent`, ending with exactly one
            `FinishEvent` or `ErrorEvent`. Closing the iterator early aborts the request.
        """
        ...

    async def abort(self, request_id: str) -> None:
        """Stop a request; its stream ends with finish_reason "abort". Unknown ids are ignored."""
        ...

    async def count_tokens(self, request: GenerationRequest) -> int:
        """The number of prompt tokens `request` would use (after chat-template rendering)."""
        ...

    def stats(self) -> EngineStats:
        """A snapshot of throughput, queue, cache and memory counters (cheap; no engine round trip)."""
        ...

    def models(self) -> list[ModelInfo]:
        """The models this engine serves; the first is the default."""
        ...
