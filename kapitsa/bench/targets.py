"""Where bench requests go: an in-process `EngineClient`, or an OpenAI-compatible HTTP endpoint.

Both return the same `StreamResult`, so the runner measures every engine the same way: time to
the first generated text, total time, and the token counts the engine itself reports.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from kapitsa.engine.client import EngineClient
from kapitsa.engine.types import (
    EngineStats,
    ErrorEvent,
    FinishEvent,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
)
from kapitsa.errors import InvalidRequest, KapitsaError

Message = dict[str, str]


@dataclass(slots=True, frozen=True)
class StreamResult:
    """One streamed completion as the bench saw it. `None` = the engine did not report it."""

    prompt_tokens: int | None
    completion_tokens: int
    cached_tokens: int | None
    ttft_s: float
    total_s: float
    prefill_s: float | None = None  # engine-measured, when the engine reports it
    decode_s: float | None = None
    draft_proposed: int | None = None
    draft_accepted: int | None = None


class BenchTarget(Protocol):
    name: str
    kind: str
    url: str | None
    model: str | None

    async def prepare(self) -> None:
        """Anything to settle before the first request (which model an endpoint serves)."""
        ...

    async def complete(self, messages: list[Message], *, max_tokens: int) -> StreamResult: ...

    def speculative(self) -> str | None:
        """The speculative mode in use, or None when the engine does not say."""
        ...

    async def acceptance_rate(self) -> float | None:
        """Accepted over proposed draft tokens in the engine's lifetime, or None when it does not say."""
        ...

    async def aclose(self) -> None: ...


class EngineTarget:
    """Benchmarks an `EngineClient` directly (no HTTP), greedy, ignoring EOS for fixed lengths."""

    kind = "in-process"
    url = None

    def __init__(self, client: EngineClient, *, name: str = "kapitsa") -> None:
        self.client = client
        self.name = name
        models = client.models()
        self.model = models[0].id if models else None

    async def prepare(self) -> None:
        return None

    async def complete(self, messages: list[Message], *, max_tokens: int) -> StreamResult:
        sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        request = GenerationRequest(messages=tuple(messages), sampling=sampling)
        started = time.perf_counter()
        first: float | None = None
        # closed on the way out, not later by the event loop: the stream holds the engine
        async with contextlib.aclosing(self.client.generate(request)) as events:
            async for event in events:
                if isinstance(event, TokenEvent) and first is None and event.token_ids:
                    first = time.perf_counter()
                elif isinstance(event, ErrorEvent):
                    raise event.error
                elif isinstance(event, FinishEvent):
                    return _from_usage(event, started=started, first=first)
        raise KapitsaError("the engine stream ended without a finish event")

    def speculative(self) -> str | None:
        return self.client.stats().speculative

    async def acceptance_rate(self) -> float | None:
        return self.client.stats().draft_acceptance_rate

    async def aclose(self) -> None:
        return None


def _from_usage(event: FinishEvent, *, started: float, first: float | None) -> StreamResult:
    ended = time.perf_counter()
    usage = event.usage
    return StreamResult(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        cached_tokens=usage.cached_tokens,
        ttft_s=(first or ended) - started,
        total_s=ended - started,
        prefill_s=usage.prefill_seconds or None,
        decode_s=usage.decode_seconds or None,
        draft_proposed=usage.draft_tokens_proposed,
        draft_accepted=usage.draft_tokens_accepted,
    )


def normalize_base_url(url: str) -> tuple[str, str | None]:
    """Split `http://host:port[/v1][#model]` into (`…/v1` base URL, model or None)."""
    base, _, model = url.partition("#")
    base = base.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise InvalidRequest(f"not an http(s) URL: {url!r}")
    if not base.endswith("/v1"):
        base += "/v1"
    return base, (model or None)


class HttpTarget:
    """Benchmarks an OpenAI-compatible `/v1/chat/completions` endpoint with streaming."""

    kind = "http"

    def __init__(
        self,
        url: str,
        *,
        name: str | None = None,
        stats: Callable[[], EngineStats] | None = None,
        api_key: str | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        self.url, self.model = normalize_base_url(url)
        self.name = name or self.url
        self._stats = stats  # an in-process engine behind this URL can say more than HTTP does
        self._served: ServedMetrics | None = None  # what a kapitsa server's /metrics says
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), headers=headers)

    async def prepare(self) -> None:
        """Pick the model when the URL did not name one: the endpoint's only model, if it has one."""
        self._served = await self._read_metrics()
        if self.model is not None:
            return
        try:
            response = await self._http.get(f"{self.url}/models")
            ids = [m["id"] for m in response.json().get("data", [])] if response.is_success else []
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
            ids = []
        if len(ids) > 1:
            listed = ", ".join(ids[:8])
            raise InvalidRequest(
                f"{self.url} serves several models ({listed}); pick one with {self.url}#MODEL"
            )
        self.model = ids[0] if ids else None

    async def complete(self, messages: list[Message], *, max_tokens: int) -> StreamResult:
        body: dict[str, Any] = {
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.model is not None:
            body["model"] = self.model
        started = time.perf_counter()
        try:
            async with self._http.stream("POST", f"{self.url}/chat/completions", json=body) as response:
                if not response.is_success:
                    await response.aread()
                    raise KapitsaError(f"{self.url} answered {response.status_code}: {response.text[:300]}")
                return await _read_sse(response, started=started)
        except httpx.HTTPError as err:
            raise KapitsaError(f"cannot reach {self.url}: {err}") from err

    def speculative(self) -> str | None:
        if self._stats:
            return self._stats().speculative
        return self._served.speculative if self._served else None

    async def acceptance_rate(self) -> float | None:
        if self._stats:
            return self._stats().draft_acceptance_rate
        served = await self._read_metrics()
        return served.draft_acceptance_rate if served else None

    async def _read_metrics(self) -> ServedMetrics | None:
        """`GET /metrics` beside `/v1`: a kapitsa server's mode and acceptance (None from other servers)."""
        try:
            response = await self._http.get(f"{self.url.removesuffix('/v1')}/metrics", timeout=10.0)
        except httpx.HTTPError:
            return None
        return parse_kapitsa_metrics(response.text) if response.is_success else None

    async def aclose(self) -> None:
        await self._http.aclose()


@dataclass(slots=True, frozen=True)
class ServedMetrics:
    speculative: str
    draft_acceptance_rate: float | None


_INFO_SPECULATIVE = re.compile(r'^kapitsa_info\{[^}]*\bspeculative="([^"]*)"', re.MULTILINE)
_ACCEPTANCE = re.compile(r"^kapitsa_draft_acceptance_rate\s+(\S+)", re.MULTILINE)


def parse_kapitsa_metrics(text: str) -> ServedMetrics | None:
    """The speculative mode and draft acceptance from kapitsa's Prometheus text; None if it is not kapitsa's."""
    mode = _INFO_SPECULATIVE.search(text)
    if mode is None:
        return None
    rate = _ACCEPTANCE.search(text)
    try:
        acceptance = float(rate.group(1)) if rate else None
    except ValueError:
        acceptance = None
    return ServedMetrics(speculative=mode.group(1), draft_acceptance_rate=acceptance)


async def _read_sse(response: httpx.Response, *, started: float) -> StreamResult:
    first: float | None = None
    content_chunks = 0
    usage: dict[str, Any] | None = None
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            break
        chunk = json.loads(payload)
        if chunk.get("error"):
            raise KapitsaError(f"stream error: {chunk['error']}")
        usage = chunk.get("usage") or usage
        if _has_text(chunk):
            content_chunks += 1
            first = first or time.perf_counter()
    ended = time.perf_counter()
    return _result_from_openai_usage(
        usage, content_chunks, ttft_s=(first or ended) - started, total_s=ended - started
    )


def _has_text(chunk: dict[str, Any]) -> bool:
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning"):
            return True
    return False


def _result_from_openai_usage(
    usage: dict[str, Any] | None, content_chunks: int, *, ttft_s: float, total_s: float
) -> StreamResult:
    """Token counts from the final usage chunk; without one, count streamed chunks (about one token each)."""
    if not usage:
        return StreamResult(None, content_chunks, None, ttft_s=ttft_s, total_s=total_s)
    details = usage.get("prompt_tokens_details") or {}
    return StreamResult(
        prompt_tokens=usage.get("prompt_tokens"),
        completion_tokens=int(usage.get("completion_tokens") or content_chunks),
        cached_tokens=details.get("cached_tokens"),
        ttft_s=ttft_s,
        total_s=total_s,
    )
