"""`POST /v1/messages` and `/v1/messages/count_tokens` (what Claude Code speaks).

Stream order: message_start, ping, (content_block_start, *_delta…, content_block_stop)…, message_delta,
message_stop; `ping` also whenever the engine is quiet (long prefill), so Claude Code's idle watchdog keeps waiting.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kapitsa.engine.types import (
    ErrorEvent,
    FinishEvent,
    GenerationRequest,
    ModelInfo,
    PrefillProgressEvent,
    Usage,
)
from kapitsa.errors import KapitsaError
from kapitsa.server.anthropic_input import (
    CountTokensRequest,
    MessagesRequest,
    assistant_prefill,
    chat_messages,
    chat_tools,
    output_schema,
    thinking_budget,
    thinking_choice,
)
from kapitsa.server.budget import with_reasoning_budget
from kapitsa.server.common import (
    CLIENT_GONE_STATUS,
    SSE_HEADERS,
    collect_steps,
    make_sampling,
    resolve_model,
    sse,
    start_run,
    state_of,
    steps,
    thinking_kwargs,
    usage_cache_written,
    usage_cached,
)
from kapitsa.server.constraints import anthropic_constraint
from kapitsa.server.errors import ApiError, anthropic_error_body, api_error_from_kapitsa
from kapitsa.server.images import take_images
from kapitsa.server.input_checks import check_prompt_size
from kapitsa.server.json_body import WellFormedJsonRoute
from kapitsa.server.output import OutputParser, ReasoningPart, TextPart
from kapitsa.server.prefill import check_unforced, starts_in_reasoning
from kapitsa.server.streaming import ClientGone, GenerationRun
from kapitsa.server.tool_calls import ToolCall

router = APIRouter(route_class=WellFormedJsonRoute)


def anthropic_usage(usage: Usage) -> dict[str, Any]:
    # Anthropic counts cache reads and writes apart from `input_tokens` (total input = input + cache read
    # + cache write); the engine's checkpoints during the prompt are its cache writes.
    cached = usage_cached(usage)
    written = usage_cache_written(usage)
    return {
        "input_tokens": usage.prompt_tokens - cached - written,
        "output_tokens": usage.completion_tokens,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": written,
    }


def start_usage(report: PrefillProgressEvent | None) -> dict[str, Any]:
    """`message_start`'s usage: the prompt's size and cached part, when the engine has reported them
    (nothing is written to the cache yet; `message_delta` carries the final figures)."""
    if report is None:
        return anthropic_usage(Usage())
    cached = min(report.cached_tokens, report.total_tokens)
    return anthropic_usage(Usage(prompt_tokens=report.total_tokens, cached_tokens=cached))


def stop_reason(finish: FinishEvent, has_tool_use: bool) -> str:
    if has_tool_use and finish.finish_reason in ("stop", "tool_calls"):
        return "tool_use"
    if finish.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if finish.stop_sequence else "end_turn"


def tool_use_id(call: ToolCall) -> str:
    return "toolu_" + call.id.removeprefix("call_")


class MessageBuilder:
    """Content blocks and SSE events from parsed parts (pure; no I/O)."""

    def __init__(self, *, message_id: str, model: str) -> None:
        self.message_id, self.model = message_id, model
        self.blocks: list[dict[str, Any]] = []
        self.open_kind: str | None = None

    def opening(self, report: PrefillProgressEvent | None = None) -> list[bytes]:
        message = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": start_usage(report),
        }
        return [sse({"type": "message_start", "message": message}, "message_start"), self.ping()]

    @staticmethod
    def ping() -> bytes:
        return sse({"type": "ping"}, "ping")

    def parts(self, parts: list[Any]) -> list[bytes]:
        frames: list[bytes] = []
        for part in parts:
            if isinstance(part, ToolCall):
                frames += self._close() + self._tool_use(part)
            else:
                frames += self._delta(part)
        return frames

    def _delta(self, part: TextPart | ReasoningPart) -> list[bytes]:
        kind = "thinking" if isinstance(part, ReasoningPart) else "text"
        frames = [] if self.open_kind == kind else self._close() + self._open(kind)
        block = self.blocks[-1]
        block[kind] += part.text
        delta = (
            {"type": "thinking_delta", "thinking": part.text}
            if kind == "thinking"
            else {"type": "text_delta", "text": part.text}
        )
        return frames + [self._event("content_block_delta", delta=delta)]

    def _open(self, kind: str) -> list[bytes]:
        self.open_kind = kind
        block = (
            {"type": "thinking", "thinking": "", "signature": ""}
            if kind == "thinking"
            else {"type": "text", "text": ""}
        )
        self.blocks.append(block)
        return [self._event("content_block_start", content_block=dict(block))]

    def _close(self) -> list[bytes]:
        kind, self.open_kind = self.open_kind, None
        if kind is None:
            return []
        frames = []
        if kind == "thinking":
            frames.append(
                self._event("content_block_delta", delta={"type": "signature_delta", "signature": ""})
            )
        return frames + [self._event("content_block_stop")]

    def _tool_use(self, call: ToolCall) -> list[bytes]:
        block = {
            "type": "tool_use",
            "id": tool_use_id(call),
            "name": call.name,
            "input": json.loads(call.arguments),
        }
        self.blocks.append(block)
        return [
            self._event("content_block_start", content_block={**block, "input": {}}),
            self._event(
                "content_block_delta", delta={"type": "input_json_delta", "partial_json": call.arguments}
            ),
            self._event("content_block_stop"),
        ]

    def _event(self, kind: str, **fields: Any) -> bytes:
        return sse({"type": kind, "index": len(self.blocks) - 1, **fields}, kind)

    def has_tool_use(self) -> bool:
        return any(b["type"] == "tool_use" for b in self.blocks)

    def closing(self, finish: FinishEvent) -> list[bytes]:
        frames = self._close()
        delta = {
            "stop_reason": stop_reason(finish, self.has_tool_use()),
            "stop_sequence": finish.stop_sequence,
        }
        frames.append(
            sse(
                {"type": "message_delta", "delta": delta, "usage": anthropic_usage(finish.usage)},
                "message_delta",
            )
        )
        return frames + [sse({"type": "message_stop"}, "message_stop")]

    def message(self, finish: FinishEvent) -> dict[str, Any]:
        self._close()
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": self.blocks,
            "stop_reason": stop_reason(finish, self.has_tool_use()),
            "stop_sequence": finish.stop_sequence,
            "usage": anthropic_usage(finish.usage),
        }

    @staticmethod
    def failure(error: Exception) -> list[bytes]:
        err = (
            api_error_from_kapitsa(error)
            if isinstance(error, KapitsaError)
            else ApiError(500, f"Generation failed: {error}")
        )
        return [sse(anthropic_error_body(err), "error")]


def to_generation_request(body: MessagesRequest, model: ModelInfo) -> GenerationRequest:
    thinking = thinking_choice(body)
    tools = chat_tools(body)
    prefill = assistant_prefill(body)
    if prefill:
        forced = (body.tool_choice or {}).get("type") in ("any", "tool") or output_schema(body) is not None
        check_unforced(prefill, forced=forced, field="messages")
    reasoning = starts_in_reasoning(model, thinking, prefill)
    messages, images = take_images(chat_messages(body), model)
    return GenerationRequest(
        messages=tuple(messages),
        images=images,
        tools=tuple(tools or ()) or None,
        model=model.id,
        sampling=make_sampling(
            model,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            stop=body.stop_sequences,
            max_tokens=body.max_tokens,
            constraint=anthropic_constraint(body, model, tools, thinking, reasoning),
            reasoning_budget=thinking_budget(body, model, reasoning),
        ),
        continue_final_message=prefill is not None,
        chat_template_kwargs=thinking_kwargs(thinking),
        request_id=f"msg_{uuid.uuid4().hex[:24]}",
    )


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request) -> Any:
    state = state_of(request)
    model = resolve_model(state.client, body.model, anthropic=True)
    reasoning = starts_in_reasoning(model, thinking_choice(body), assistant_prefill(body))
    gen = with_reasoning_budget(
        to_generation_request(body, model), model, reasoning=reasoning, budget=state.settings.reasoning_budget
    )
    parser = OutputParser(
        thinking=reasoning,
        tools=list(gen.tools or []) or None,
        one_call=bool((body.tool_choice or {}).get("disable_parallel_tool_use")),
    )
    builder = MessageBuilder(message_id=gen.request_id, model=body.model or model.id)
    run = await start_run(request, gen)
    if body.stream:
        return StreamingResponse(
            _stream(run, parser, builder), media_type="text/event-stream", headers=SSE_HEADERS
        )
    return await _collect(run, parser, builder)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request) -> dict[str, int]:
    client = state_of(request).client
    model = resolve_model(client, body.model, anthropic=True)
    gen = to_generation_request(body, model)
    check_prompt_size(gen, model)
    return {"input_tokens": await client.count_tokens(gen)}


async def _collect(run: GenerationRun, parser: OutputParser, builder: MessageBuilder) -> JSONResponse:
    done = await collect_steps(run, parser)
    if done is None:
        return JSONResponse({}, status_code=CLIENT_GONE_STATUS)
    for step in done:
        builder.parts(step.parts)
    return JSONResponse(builder.message(done[-1].final))


async def _stream(run: GenerationRun, parser: OutputParser, builder: MessageBuilder) -> AsyncIterator[bytes]:
    try:
        for frame in builder.opening(await run.prompt_report(run.keepalive_s)):
            yield frame
        async for step in steps(run, parser):
            if step.keepalive:
                yield builder.ping()
            for frame in builder.parts(step.parts):
                yield frame
            if isinstance(step.final, FinishEvent):
                for frame in builder.closing(step.final):
                    yield frame
            elif isinstance(step.final, ErrorEvent):
                for frame in builder.failure(step.final.error):
                    yield frame
    except ClientGone:
        return
    finally:
        await run.close()
