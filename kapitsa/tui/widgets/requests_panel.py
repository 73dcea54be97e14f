"""Active and queued requests, batch size, and speculative decoding acceptance."""

from __future__ import annotations

from textual.widgets import Static

from kapitsa.engine.types import EngineStats


class RequestsPanel(Static):
    def on_mount(self) -> None:
        self.border_title = "Requests"
        self.update("engine not running")

    def show(self, stats: EngineStats) -> None:
        speculative = (
            "off"
            if stats.speculative == "none"
            else f"{stats.speculative} · {stats.draft_acceptance_rate:.0%} accepted · "
            f"{stats.tokens_per_step:.2f} tok/step"
        )
        self.update(
            f"active   {stats.active_requests:>6}    queued {stats.queued_requests:>6}\n"
            f"batch    {stats.batch_size:>6}    done   {stats.requests_finished:>6}\n"
            f"failed   {stats.requests_failed:>6}    tokens {stats.generated_tokens:>6}\n"
            f"speculative  {speculative}"
        )
