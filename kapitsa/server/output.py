"""Model text → typed parts (reasoning, answer text, tool calls), chunk by chunk. One parser per generation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kapitsa.server.reasoning import ThinkSplitter
from kapitsa.server.tool_calls import ToolCall, ToolCallParser


@dataclass(slots=True, frozen=True)
class TextPart:
    text: str


@dataclass(slots=True, frozen=True)
class ReasoningPart:
    text: str


Part = TextPart | ReasoningPart | ToolCall


class OutputParser:
    """Splits `<think>` first, then finds tool calls in the answer (only when the request declared tools)."""

    def __init__(self, *, thinking: bool, tools: list[dict[str, Any]] | None, one_call: bool = False) -> None:
        """`one_call`: the request turned parallel tool calls off; a call after the first is dropped
        (a required turn's grammar already holds one; an `auto` turn's output is free)."""
        self._think = ThinkSplitter(starts_in_reasoning=thinking)
        self._tools = ToolCallParser(tools) if tools else None
        self._one_call = one_call
        self.tool_calls: list[ToolCall] = []
        self._truncated = False
        self.reasoning_tokens = 0
        self._undecided_tokens = 0  # produced while nothing told reasoning from answer yet

    def feed(self, text: str, tokens: int = 0) -> list[Part]:
        """Parts completed by `text`; `tokens` (how many produced it) count as reasoning inside `<think>`."""
        watching = self._think.channel == "reasoning" or self._think.at_start
        pieces = self._think.feed(text)
        if watching:
            self._count_reasoning(text, pieces, tokens)
        return self._route(pieces, final=False)

    def _count_reasoning(self, text: str, pieces: list[tuple[str, str]], tokens: int) -> None:
        """Tokens stay undecided until the splitter routes text: all reasoning (or held inside
        `<think>`) counts whole; an event that crosses `</think>` (several tokens under speculative
        decoding) counts its share by characters (all but the answer's); an answer that opens without
        `<think>` counts none."""
        self._undecided_tokens += tokens
        reasoning = any(channel == "reasoning" for channel, _ in pieces)
        content = sum(len(t) for channel, t in pieces if channel == "content")
        if content:  # the tags and the newlines after `</think>` are the reasoning's
            share = round(self._undecided_tokens * max(0, len(text) - content) / max(len(text), 1))
        elif reasoning or not self._think.at_start:  # reasoning, a held tag, or `</think>` itself
            share = self._undecided_tokens
        else:
            return  # whitespace or a partial `<think>` at the start: still undecided
        self.reasoning_tokens += share
        self._undecided_tokens = 0

    def finish(self, *, truncated: bool = False) -> list[Part]:
        """The rest of the output; `truncated` when the token limit cut it."""
        self._truncated = truncated
        return self._route(self._think.flush(), final=True)

    def _route(self, pieces: list[tuple[str, str]], *, final: bool) -> list[Part]:
        parts: list[Part] = []
        for channel, text in pieces:
            if channel == "reasoning":
                parts.append(ReasoningPart(text))
            else:
                parts.extend(self._content(text))
        if final:
            parts.extend(self._content_flush())
        return _merge(parts)

    def _content(self, text: str) -> list[Part]:
        if self._tools is None:
            return [TextPart(text)]
        return [self._wrap(x) for x in self._tools.feed(text)]

    def _content_flush(self) -> list[Part]:
        return (
            []
            if self._tools is None
            else [self._wrap(x) for x in self._tools.flush(truncated=self._truncated)]
        )

    def _wrap(self, item: str | ToolCall) -> Part:
        if isinstance(item, ToolCall):
            if self._one_call and self.tool_calls:
                return TextPart("")  # (empty parts are merged away)
            self.tool_calls.append(item)
            return item
        return TextPart(item)


def _merge(parts: list[Part]) -> list[Part]:
    merged: list[Part] = []
    for part in parts:
        last = merged[-1] if merged else None
        if isinstance(part, TextPart) and isinstance(last, TextPart):
            merged[-1] = TextPart(last.text + part.text)
        elif isinstance(part, ReasoningPart) and isinstance(last, ReasoningPart):
            merged[-1] = ReasoningPart(last.text + part.text)
        elif not isinstance(part, (TextPart, ReasoningPart)) or part.text:
            merged.append(part)
    return merged
