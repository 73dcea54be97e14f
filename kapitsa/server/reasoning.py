"""Split streamed model text into reasoning (`<think>…</think>`) and answer, without leaking half tags.

Thinking templates (Qwen3.5, Nemotron-H) often open `<think>` inside the prompt, so the output may start in
reasoning with no open tag; a model may also write the open tag itself. Only a `<think>` at the very start
of the output opens reasoning: the literal text later in an answer is ordinary content.
"""

from __future__ import annotations

from typing import Literal

OPEN_TAG = "<think>"
CLOSE_TAG = "</think>"
Channel = Literal["reasoning", "content"]


def held_suffix_length(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that could still grow into one of `tags`."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), 0, -1):
            if text.endswith(tag[:n]):
                best = max(best, n)
                break
    return best


class ThinkSplitter:
    def __init__(self, *, starts_in_reasoning: bool) -> None:
        self.channel: Channel = "reasoning" if starts_in_reasoning else "content"
        self._buffer = ""
        self._at_start = True  # nothing but whitespace seen yet
        self._trim_next = False  # drop the newlines a template puts right after </think>

    def feed(self, text: str) -> list[tuple[Channel, str]]:
        self._buffer += text
        out: list[tuple[Channel, str]] = []
        while self._buffer:
            if self._at_start and not self._consume_start():
                break
            if self.channel == "reasoning":
                if not self._emit_reasoning(out):
                    break
            else:
                self._emit_content(out)
                break
        return [(c, t) for c, t in out if t]

    @property
    def at_start(self) -> bool:
        """Nothing but whitespace seen yet (a leading `<think>` may still come)."""
        return self._at_start

    def flush(self) -> list[tuple[Channel, str]]:
        """Everything still held, at the end of the output."""
        text, self._buffer = self._buffer, ""
        if self._trim_next:
            text = text.lstrip("\n")
        return [(self.channel, text)] if text else []

    def _consume_start(self) -> bool:
        """Handle a leading `<think>`; False while the start is still ambiguous."""
        stripped = self._buffer.lstrip()
        if not stripped:
            return False
        if stripped.startswith(OPEN_TAG):
            self._buffer = stripped[len(OPEN_TAG) :].lstrip("\n")
            self.channel = "reasoning"
        elif OPEN_TAG.startswith(stripped):
            return False
        self._at_start = False
        return True

    def _emit_reasoning(self, out: list[tuple[Channel, str]]) -> bool:
        end = self._buffer.find(CLOSE_TAG)
        if end < 0:
            keep = held_suffix_length(self._buffer, (CLOSE_TAG,))
            out.append(("reasoning", self._buffer[: len(self._buffer) - keep]))
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return False
        out.append(("reasoning", self._buffer[:end].rstrip("\n")))
        self._buffer = self._buffer[end + len(CLOSE_TAG) :]
        self.channel = "content"
        self._trim_next = True
        return True

    def _emit_content(self, out: list[tuple[Channel, str]]) -> None:
        text, self._buffer = self._buffer, ""
        if self._trim_next:
            text = text.lstrip("\n")
            if not text:
                return
            self._trim_next = False
        out.append(("content", text))
