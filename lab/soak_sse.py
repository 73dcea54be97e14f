"""Strict readers of the three APIs' SSE streams, for the soak benchmark (lab/soak.py).

`SseReader` cuts bytes into frames and says which are malformed (a line that is no `event:`, `data:` or
comment, data that is no JSON, an event name that disagrees with the data's `type`); `StreamCheck`
subclasses check the order each API promises (first and last events, sequence numbers, block indices).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Frame:
    event: str | None
    data: Any  # parsed JSON, "[DONE]", or None for a comment-only frame


@dataclass
class SseReader:
    """Frames from a byte stream; `malformed` counts frames that break the SSE or JSON rules."""

    buffer: bytes = b""
    malformed: int = 0
    problems: list[str] = field(default_factory=list)

    def feed(self, chunk: bytes) -> list[Frame]:
        self.buffer += chunk
        *complete, self.buffer = self.buffer.split(b"\n\n")
        return [frame for raw in complete if (frame := self._frame(raw)) is not None]

    def _frame(self, raw: bytes) -> Frame | None:
        event, data, comment = None, None, False
        for line in raw.decode("utf-8", errors="strict").split("\n"):
            if line.startswith(":"):
                comment = True
            elif line.startswith("event: ") and event is None:
                event = line[7:]
            elif line.startswith("data: ") and data is None:
                data = line[6:]
            else:
                return self._bad(f"bad line {line[:60]!r}")
        if data is None:
            return None if comment and event is None else self._bad("a frame without data")
        if data == "[DONE]":
            return Frame(event, data)
        try:
            parsed = json.loads(data)
        except ValueError:
            return self._bad(f"data that is no JSON: {data[:60]!r}")
        if event is not None and (not isinstance(parsed, dict) or parsed.get("type") != event):
            return self._bad(f"event {event!r} with data of type {parsed.get('type')!r}")
        return Frame(event, parsed)

    def _bad(self, problem: str) -> None:
        self.malformed += 1
        self.problems.append(problem)
        return None


class StreamCheck:
    """Order checks for one stream; `errors` lists broken promises, `finished` says the end arrived."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.frames = 0
        self.finished = False

    def add(self, frame: Frame) -> None:
        if self.finished:
            self.errors.append("a frame after the end")
        self.frames += 1
        self.check(frame)

    def check(self, frame: Frame) -> None:  # pragma: no cover - per API
        raise NotImplementedError


class ChatCheck(StreamCheck):
    """Chat and text completions: JSON chunks of one id, then `[DONE]`."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind, self.ids = kind, set()

    def check(self, frame: Frame) -> None:
        if frame.data == "[DONE]":
            self.finished = True
            return
        body = frame.data
        if "error" in body:
            self.errors.append(f"error: {body['error'].get('message')}")
            return
        if body.get("object") != self.kind:
            self.errors.append(f"object {body.get('object')!r}")
        self.ids.add(body.get("id"))
        if len(self.ids) > 1:
            self.errors.append("chunks of several ids")


class MessagesCheck(StreamCheck):
    """Anthropic: message_start first, blocks opened and closed in index order, message_stop last."""

    def __init__(self) -> None:
        super().__init__()
        self.open_index: int | None = None
        self.next_index = 0

    def check(self, frame: Frame) -> None:
        kind = frame.data.get("type") if isinstance(frame.data, dict) else None
        if (self.frames == 1) != (kind == "message_start"):
            self.errors.append(f"{kind} as frame {self.frames}")
        if kind == "content_block_start":
            self._start(frame.data.get("index"))
        elif (
            kind in ("content_block_delta", "content_block_stop")
            and frame.data.get("index") != self.open_index
        ):
            self.errors.append(f"{kind} for block {frame.data.get('index')}, open is {self.open_index}")
        if kind == "content_block_stop":
            self.open_index = None
        elif kind == "error":
            self.errors.append(f"error: {frame.data.get('error')}")
        elif kind == "message_stop":
            if self.open_index is not None:
                self.errors.append("message_stop inside a block")
            self.finished = True

    def _start(self, index: Any) -> None:
        if self.open_index is not None or index != self.next_index:
            self.errors.append(f"block {index} opened (open {self.open_index}, next {self.next_index})")
        self.open_index, self.next_index = index, (index if isinstance(index, int) else 0) + 1


class ResponsesCheck(StreamCheck):
    """Responses: sequence numbers 0, 1, 2, ...; created first; completed/incomplete/failed last."""

    ENDS = ("response.completed", "response.incomplete", "response.failed")

    def check(self, frame: Frame) -> None:
        kind = frame.data.get("type")
        if frame.data.get("sequence_number") != self.frames - 1:
            self.errors.append(f"sequence_number {frame.data.get('sequence_number')} at {self.frames - 1}")
        if (self.frames == 1) != (kind == "response.created"):
            self.errors.append(f"{kind} as frame {self.frames}")
        if kind == "response.failed":
            self.errors.append(f"failed: {frame.data['response'].get('error')}")
        self.finished = kind in self.ENDS
