"""Active and queued requests, batch size, and speculative decoding acceptance."""

from __future__ import annotations

from textual.widgets import Static

from kapitsa.engine.types import EngineStats


class RequestsPanel(Static):
    def on_mount(self) -> None:
        self.border_title = "Requests"
        self.update("engine not running")

    def show(self, stats: EngineStats) -> None:
        if stats.speculative == "none":
            speculative = "speculative  off"
        else:
            speculative = f"speculative  {stats.speculative}, {_acceptance(stats)}\ntokens/step  {stats.tokens_per_step:.2f}"
        self.update(
            f"active  {stats.active_requests:>5}   queued {stats.queued_requests:>6}\n"
            f"batch   {stats.batch_size:>5}   done   {stats.requests_finished:>6}\n"
            f"failed  {stats.requests_failed:>5}   tokens {stats.generated_tokens:>6}\n"
            f"{speculative}"
        )


def _acceptance(stats: EngineStats) -> str:
    # A zero rate while steps yield more than one token means the engine does not count drafts.
    if stats.draft_acceptance_rate == 0 and stats.tokens_per_step > 1.0:
        return "acceptance not reported"
    return f"{stats.draft_acceptance_rate:.0%} accepted"
