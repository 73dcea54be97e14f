"""`POST /v1/chat/completions`: parse → `GenerationRequest` → stream or collect → chat.completion(.chunk)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kapitsa.engine.types import ErrorEvent, FinishEvent, Usage
from kapitsa.errors import KapitsaError
from kapitsa.server.budget import with_reasoning_budget
from kapitsa.server.chat_input import chat_reasoning, to_generation_request
from kapitsa.server.common import (
    CLIENT_GONE_STATUS,
    SSE_COMMENT,
    SSE_HEADERS,
    Step,
    choice_usage,
    collect_steps,
    logprob_entries,
    now,
    resolve_model,
    sse,
    start_run,
    state_of,
    steps,
    usage_cache_written,
    usage_cached,
)
from kapitsa.server.errors import api_error_from_kapitsa, openai_error_body
from kapitsa.server.json_body import WellFormedJsonRoute
from kapitsa.server.openai_models import ChatRequest
from kapitsa.server.output import OutputParser, ReasoningPart, TextPart
from kapitsa.server.streaming import ClientGone, GenerationRun
from kapitsa.server.tool_calls import ToolCall

router = APIRouter(route_class=WellFormedJsonRoute)


# ---- response rendering (pure) -------------------------------------------------------------------------


def openai_usage(usage: Usage, reasoning_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage. The prediction counts are speculative decoding's drafts copied from the
    request's `prediction`, kept and thrown away (drafts copied from the context are not the
    prediction's: without a prediction both are 0)."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {
            "cached_tokens": usage_cached(usage),
            "cache_write_tokens": usage_cache_written(usage),
        },
        "completion_tokens_details": {
            "reasoning_tokens": min(reasoning_tokens, usage.completion_tokens),
            "accepted_prediction_tokens": usage.prediction_tokens_accepted,
            "rejected_prediction_tokens": usage.prediction_tokens_proposed - usage.prediction_tokens_accepted,
        },
    }


def finish_reason(finish: FinishEvent, has_tool_calls: bool) -> str:
    if has_tool_calls and finish.finish_reason in ("stop", "tool_calls"):
        return "tool_calls"
    return "length" if finish.finish_reason == "length" else "stop"


def tool_call_dict(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
    return out if index is None else {"index": index, **out}


class ChatChunker:
    """Turns `Step`s into `chat.completion.chunk` SSE frames: role first, finish_reason last, then usage, [DONE].

    With n choices every frame names its choice's `index`; each choice opens with its role and closes with
    its finish_reason, and the usage (prompt once, completions summed) and [DONE] follow the last one.
    """

    def __init__(
        self, *, completion_id: str, model: str, include_usage: bool, want_logprobs: bool, n: int = 1
    ) -> None:
        self.base = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": now(),
            "model": model,
            "system_fingerprint": None,
        }
        self.include_usage = include_usage
        self.want_logprobs = want_logprobs
        self.n = n
        self.tool_calls = [0] * n  # per choice
        self.finishes: list[FinishEvent] = []
        self.reasoning_tokens = 0

    def chunk(
        self, delta: dict[str, Any], *, finish: str | None = None, logprobs: Any = None, index: int = 0
    ) -> bytes:
        choice: dict[str, Any] = {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish,
        }
        body = {**self.base, "choices": [choice]}
        if self.include_usage:
            body["usage"] = None
        return sse(body)

    def opening(self) -> bytes:
        return b"".join(self.chunk({"role": "assistant", "content": ""}, index=i) for i in range(self.n))

    def step(self, step: Step) -> list[bytes]:
        frames = [self.chunk(d, index=step.index) for d in self._deltas(step.parts, step.index)]
        if self.want_logprobs and step.logprobs:
            logprobs = {"content": logprob_entries(step.logprobs)}
            frames.append(self.chunk({}, logprobs=logprobs, index=step.index))
        return frames

    def _deltas(self, parts: list[Any], index: int) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        for part in parts:
            if isinstance(part, TextPart):
                deltas.append({"content": part.text})
            elif isinstance(part, ReasoningPart):
                deltas.append({"reasoning_content": part.text})
            elif isinstance(part, ToolCall):
                deltas.append({"tool_calls": [tool_call_dict(part, self.tool_calls[index])]})
                self.tool_calls[index] += 1
        return deltas

    def closing(self, finish: FinishEvent, reasoning_tokens: int = 0, index: int = 0) -> list[bytes]:
        """The finish chunk of choice `index`; after the last choice, the usage and [DONE]."""
        frames = [self.chunk({}, finish=finish_reason(finish, self.tool_calls[index] > 0), index=index)]
        self.finishes.append(finish)
        self.reasoning_tokens += reasoning_tokens
        if len(self.finishes) < self.n:
            return frames
        if self.include_usage:
            usage = openai_usage(choice_usage(self.finishes), self.reasoning_tokens)
            frames.append(sse({**self.base, "choices": [], "usage": usage}))
        return frames + [b"data: [DONE]\n\n"]

    def failure(self, error: Exception) -> list[bytes]:
        return failure_frames(error)


def failure_frames(error: Exception) -> list[bytes]:
    """A mid-stream failure: one error object in OpenAI's shape, then [DONE] (vLLM's convention)."""
    err = api_error_from_kapitsa(error) if isinstance(error, KapitsaError) else None
    body = (
        openai_error_body(err)
        if err
        else {
            "error": {
                "message": f"Generation failed: {error}",
                "type": "server_error",
                "param": None,
                "code": "engine_error",
            }
        }
    )
    return [sse(body), b"data: [DONE]\n\n"]


def chat_choice(index: int, parts: list[Any], logprobs: list[Any], finish: FinishEvent) -> dict[str, Any]:
    """One `choices[]` entry of a chat.completion."""
    text = "".join(p.text for p in parts if isinstance(p, TextPart))
    reasoning = "".join(p.text for p in parts if isinstance(p, ReasoningPart))
    calls = [p for p in parts if isinstance(p, ToolCall)]
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [tool_call_dict(c) for c in calls]
    return {
        "index": index,
        "message": message,
        "logprobs": {"content": logprobs} if logprobs else None,
        "finish_reason": finish_reason(finish, bool(calls)),
    }


def completion_body(
    completion_id: str, model: str, choices: list[dict[str, Any]], usage: Usage, reasoning_tokens: int = 0
) -> dict[str, Any]:
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": now(),
        "model": model,
        "system_fingerprint": None,
        "choices": choices,
        "usage": openai_usage(usage, reasoning_tokens),
    }


# ---- route ---------------------------------------------------------------------------------------------


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatRequest, request: Request) -> Any:
    state = state_of(request)
    model = resolve_model(state.client, body.model)
    reasoning = chat_reasoning(body, model)
    gen = with_reasoning_budget(
        to_generation_request(body, model), model, reasoning=reasoning, budget=state.settings.reasoning_budget
    )
    parsers = [
        OutputParser(
            thinking=reasoning,
            tools=list(gen.tools or []) or None,
            one_call=body.parallel_tool_calls is False,
        )
        for _ in range(gen.n)
    ]
    run = await start_run(request, gen)
    if not body.stream:
        return await _collect(run, parsers, model.id, want_logprobs=bool(body.logprobs))
    chunker = ChatChunker(
        completion_id=gen.request_id,
        model=model.id,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        want_logprobs=bool(body.logprobs),
        n=gen.n,
    )
    return StreamingResponse(
        _stream(run, parsers, chunker), media_type="text/event-stream", headers=SSE_HEADERS
    )


async def _collect(
    run: GenerationRun, parsers: list[OutputParser], model: str, *, want_logprobs: bool
) -> JSONResponse:
    done = await collect_steps(run, parsers)
    if done is None:
        return JSONResponse({}, status_code=CLIENT_GONE_STATUS)
    finals = sorted((s for s in done if isinstance(s.final, FinishEvent)), key=lambda s: s.index)
    choices = []
    for final in finals:
        mine = [step for step in done if step.index == final.index]
        parts = [part for step in mine for part in step.parts]
        logprobs = [e for step in mine for e in logprob_entries(step.logprobs)] if want_logprobs else []
        choices.append(chat_choice(final.index, parts, logprobs, final.final))
    usage = choice_usage([s.final for s in finals])
    reasoning_tokens = sum(s.reasoning_tokens for s in finals)
    return JSONResponse(completion_body(run.request.request_id, model, choices, usage, reasoning_tokens))


async def _stream(
    run: GenerationRun, parsers: list[OutputParser], chunker: ChatChunker
) -> AsyncIterator[bytes]:
    try:
        yield chunker.opening()
        async for step in steps(run, parsers):
            if step.keepalive:
                yield SSE_COMMENT
            for frame in chunker.step(step):
                yield frame
            if isinstance(step.final, FinishEvent):
                for frame in chunker.closing(step.final, step.reasoning_tokens, step.index):
                    yield frame
            elif isinstance(step.final, ErrorEvent):
                for frame in chunker.failure(step.final.error):
                    yield frame
    except ClientGone:
        return
    finally:
        await run.close()
