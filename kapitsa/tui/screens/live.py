"""Live panels: decode and prefill tok/s sparklines, requests, and the prefix cache."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Grid
from textual.screen import Screen
from textual.widgets import Footer, Header, Static

from kapitsa.engine.types import EngineStats
from kapitsa.tui.widgets.cache_panel import CachePanel
from kapitsa.tui.widgets.rate_panel import RatePanel
from kapitsa.tui.widgets.requests_panel import RequestsPanel


class LiveScreen(Screen):
    def __init__(self) -> None:
        super().__init__(id="live")

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static("", id="live-status")
        with Grid(id="live-grid"):
            yield RatePanel("decode", id="decode-rate")
            yield RatePanel("prefill", id="prefill-rate")
            yield RequestsPanel(id="requests")
            yield CachePanel(id="cache")
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = "live"
        self.watch(self.app, "engine_stats", self.show_stats, init=True)
        self.watch(self.app, "engine_status", self.show_status, init=True)

    def show_status(self, status: str) -> None:
        handle = self.app.engine_handle
        where = f"  {handle.model} at {handle.url}/v1" if handle and status == "running" else ""
        self.query_one("#live-status", Static).update(f"engine {status}{where}")

    def show_stats(self, stats: EngineStats | None) -> None:
        if stats is None:
            return
        self.query_one("#decode-rate", RatePanel).push(stats.decode_tok_s)
        self.query_one("#prefill-rate", RatePanel).push(stats.prefill_tok_s)
        self.query_one(RequestsPanel).show(stats)
        self.query_one(CachePanel).show(stats)
