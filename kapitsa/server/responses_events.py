"""Responses API output: the response object and its SSE events, built from parsed parts (pure; no I/O)."""

from __future__ import annotations

import json
import uuid
from typing import Any

from kapitsa.engine.types import FinishEvent, TokenLogprob, Usage
from kapitsa.errors import ContextOverflow, EngineBusy, EngineDead, KapitsaError
from kapitsa.server.common import logprob_entries, now, sse, usage_cache_written, usage_cached
from kapitsa.server.output import ReasoningPart, TextPart
from kapitsa.server.tool_calls import ToolCall


def responses_usage(usage: Usage, reasoning_tokens: int = 0) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": usage_cached(usage),
            "cache_write_tokens": usage_cache_written(usage),
        },
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, usage.completion_tokens)},
        "total_tokens": usage.total_tokens,
    }


def failure_code(error: Exception) -> str:
    if isinstance(error, ContextOverflow):
        return "context_length_exceeded"
    if isinstance(error, (EngineBusy, EngineDead)):
        return "server_is_overloaded"
    return "server_error"


class ResponseBuilder:
    """Builds the response object and its SSE events from parsed parts (pure; no I/O)."""

    def __init__(
        self,
        *,
        response_id: str,
        model: str,
        namespaces: dict[str, str],
        custom: set[str],
        client_limit: bool = False,
    ) -> None:
        self.response = {
            "id": response_id,
            "object": "response",
            "created_at": now(),
            "status": "in_progress",
            "model": model,
            "output": [],
            "usage": None,
            "error": None,
            "incomplete_details": None,
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
        }
        self.namespaces, self.custom = namespaces, custom
        self.client_limit = client_limit  # the request set `max_output_tokens`
        self.seq = 0
        self.open_item: dict[str, Any] | None = None
        # token logprobs not yet given to answer text (a step whose text the parser still holds:
        # a split UTF-8 character, a possible stop string or tool tag)
        self._pending_logprobs: list[dict[str, Any]] = []

    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(data, event=kind)

    def opening(self) -> list[bytes]:
        return [
            self.event("response.created", response=dict(self.response)),
            self.event("response.in_progress", response=dict(self.response)),
        ]

    def parts(self, parts: list[Any], logprobs: tuple[TokenLogprob, ...] | None = None) -> list[bytes]:
        """Frames for one step's parts; token `logprobs` (when asked for) ride on the next
        answer-text delta and gather in that output_text part."""
        frames: list[bytes] = []
        self._pending_logprobs += logprob_entries(logprobs)
        for part in parts:
            if isinstance(part, ToolCall):
                self._pending_logprobs = []  # the call's own tokens
                frames += self._close_open() + self._tool_call(part)
            elif isinstance(part, ReasoningPart):
                self._pending_logprobs = []  # reasoning tokens are not the answer's
                frames += self._text_delta(part, [])
            else:
                entries, self._pending_logprobs = self._pending_logprobs, []
                frames += self._text_delta(part, entries)
        return frames

    def _text_delta(self, part: TextPart | ReasoningPart, logprobs: list[dict[str, Any]]) -> list[bytes]:
        kind = "reasoning" if isinstance(part, ReasoningPart) else "message"
        frames = (
            [] if self.open_item and self.open_item["type"] == kind else self._close_open() + self._open(kind)
        )
        item, index = self.open_item, len(self.response["output"])
        assert item is not None
        item["_text"] += part.text
        delta_event = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": logprobs}
        if kind == "message":
            item["_logprobs"] += logprobs
        return frames + [
            self.event(
                delta_event, item_id=item["id"], output_index=index, content_index=0, delta=part.text, **extra
            )
        ]

    def _open(self, kind: str) -> list[bytes]:
        index = len(self.response["output"])
        if kind == "reasoning":
            self.open_item = {
                "type": "reasoning",
                "id": f"rs_{uuid.uuid4().hex[:24]}",
                "summary": [],
                "_text": "",
            }
            return [
                self.event("response.output_item.added", output_index=index, item=_public(self.open_item))
            ]
        self.open_item = {
            "type": "message",
            "id": f"msg_{uuid.uuid4().hex[:24]}",
            "status": "in_progress",
            "role": "assistant",
            "content": [],
            "_text": "",
            "_logprobs": [],
        }
        part = {"type": "output_text", "text": "", "annotations": []}
        return [
            self.event("response.output_item.added", output_index=index, item=_public(self.open_item)),
            self.event(
                "response.content_part.added",
                item_id=self.open_item["id"],
                output_index=index,
                content_index=0,
                part=part,
            ),
        ]

    def _close_open(self, status: str = "completed") -> list[bytes]:
        """Close the item being written; `status` "incomplete" when a length stop cut it."""
        item, self.open_item = self.open_item, None
        if item is None:
            return []
        index, text = len(self.response["output"]), item.pop("_text")
        if item["type"] == "reasoning":
            item.update(content=[{"type": "reasoning_text", "text": text}], encrypted_content=text)
            frames = [
                self.event(
                    "response.reasoning_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=text,
                )
            ]
        else:
            logprobs = item.pop("_logprobs")
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
            item.update(status=status, content=[part])
            frames = [
                self.event(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=text,
                    logprobs=logprobs,
                ),
                self.event(
                    "response.content_part.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=part,
                ),
            ]
        self.response["output"].append(item)
        return frames + [self.event("response.output_item.done", output_index=index, item=item)]

    def _tool_call(self, call: ToolCall) -> list[bytes]:
        index = len(self.response["output"])
        item = self._call_item(call)
        self.response["output"].append(item)
        if item["type"] == "custom_tool_call":
            return [
                self.event("response.output_item.added", output_index=index, item={**item, "input": ""}),
                self.event(
                    "response.custom_tool_call_input.delta",
                    item_id=item["id"],
                    output_index=index,
                    delta=item["input"],
                ),
                self.event(
                    "response.custom_tool_call_input.done",
                    item_id=item["id"],
                    output_index=index,
                    input=item["input"],
                ),
                self.event("response.output_item.done", output_index=index, item=item),
            ]
        return [
            self.event(
                "response.output_item.added",
                output_index=index,
                item={**item, "arguments": "", "status": "in_progress"},
            ),
            self.event(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=index,
                delta=call.arguments,
            ),
            self.event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                arguments=call.arguments,
                name=call.name,
            ),
            self.event("response.output_item.done", output_index=index, item=item),
        ]

    def _call_item(self, call: ToolCall) -> dict[str, Any]:
        item_id = f"fc_{uuid.uuid4().hex[:24]}"
        if call.name in self.custom:
            return {
                "type": "custom_tool_call",
                "id": item_id,
                "call_id": call.id,
                "name": call.name,
                "input": str(json.loads(call.arguments).get("input", "")),
                "status": "completed",
            }
        item = {
            "type": "function_call",
            "id": item_id,
            "call_id": call.id,
            "name": call.name,
            "arguments": call.arguments,
            "status": "completed",
        }
        if call.name in self.namespaces:
            item["namespace"] = self.namespaces[call.name]
        return item

    def finish(self, finish: FinishEvent, reasoning_tokens: int = 0) -> dict[str, Any]:
        self._close_open(_last_item_status(finish))  # `closing` makes the events; this is the body
        return self._finished(finish, reasoning_tokens)

    def _finished(self, finish: FinishEvent, reasoning_tokens: int = 0) -> dict[str, Any]:
        incomplete = finish.finish_reason == "length"
        self.response.update(
            status="incomplete" if incomplete else "completed",
            usage=responses_usage(finish.usage, reasoning_tokens),
            incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
        )
        return self.response

    def closing(self, finish: FinishEvent, reasoning_tokens: int = 0) -> list[bytes]:
        """The last events. A length stop of a request that set `max_output_tokens` ends with
        `response.incomplete`, as OpenAI's does; without one (the server's own limits cut it: the window,
        the model's longest answer) with `response.completed` + `status: "incomplete"`, since Codex, which
        sets no limit, fails the turn on `response.incomplete`."""
        frames = self._close_open(_last_item_status(finish))
        response = self._finished(finish, reasoning_tokens)
        last = "response.incomplete" if self.client_limit and response["status"] == "incomplete" else None
        return frames + [self.event(last or "response.completed", response=response)]

    def failure(self, error: Exception) -> list[bytes]:
        message = str(error) if isinstance(error, KapitsaError) else f"Generation failed: {error}"
        self.response.update(status="failed", error={"code": failure_code(error), "message": message})
        return [self.event("response.failed", response=self.response)]


def _last_item_status(finish: FinishEvent) -> str:
    return "incomplete" if finish.finish_reason == "length" else "completed"


def _public(item: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in item.items() if not k.startswith("_")}
