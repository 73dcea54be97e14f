"""A throughput number with its recent history as a sparkline."""

from __future__ import annotations

from collections import deque

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Label, Sparkline

from kapitsa.tui.widgets.formatting import rate

HISTORY = 60  # samples kept (30 s at the 0.5 s poll interval)


class RatePanel(Vertical):
    """`title` in the border, the latest value, and a sparkline of the last `HISTORY` values."""

    def __init__(self, title: str, *, id: str | None = None) -> None:  # noqa: A002 - Textual's keyword
        super().__init__(id=id, classes="rate-panel")
        self.border_title = title
        self.history: deque[float] = deque(maxlen=HISTORY)

    def compose(self) -> ComposeResult:
        yield Label("- tok/s", classes="rate-value")
        yield Sparkline(list(self.history), summary_function=max)

    def push(self, value: float) -> None:
        self.history.append(value)
        self.query_one(".rate-value", Label).update(f"{rate(value)} tok/s  (peak {rate(max(self.history))})")
        self.query_one(Sparkline).data = list(self.history)
