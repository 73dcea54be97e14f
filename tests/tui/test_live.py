"""Live panels: stats polled from `EngineClient.stats()` fill the sparklines, requests and cache panels."""

from __future__ import annotations

import pytest
from textual.widgets import Sparkline
from tui_support import BUSY_STATS, of_type, settle, wait_until

from kapitsa.tui.messages import StatsPolled
from kapitsa.tui.widgets.cache_panel import CachePanel
from kapitsa.tui.widgets.rate_panel import RatePanel
from kapitsa.tui.widgets.requests_panel import RequestsPanel


def _text(widget) -> str:
    return " ".join(str(widget.render()).split())  # layout spaces do not matter here


async def test_polled_stats_fill_every_panel(make_app, messages) -> None:
    """Check that a running engine's counters reach the decode/prefill sparklines, requests and cache panels."""
    app = make_app()
    async with app.run_test(size=(80, 24), message_hook=messages.append) as pilot:
        await settle(pilot)
        await pilot.press("s")
        await wait_until(pilot, lambda: app.engine_status == "running")
        await pilot.press("2")
        await wait_until(pilot, lambda: len(of_type(messages, StatsPolled)) >= 3)
        await pilot.pause()
        screen = app.screen
        assert screen.id == "live"
        decode = screen.query_one("#decode-rate", RatePanel)
        assert list(decode.history)[-1] == BUSY_STATS.decode_tok_s
        assert decode.query_one(Sparkline).data[-1] == BUSY_STATS.decode_tok_s
        assert "42.2 tok/s" in _text(decode.query_one(".rate-value"))
        assert list(screen.query_one("#prefill-rate", RatePanel).history)[-1] == 812.5
        requests = _text(screen.query_one(RequestsPanel))
        assert "active 2 queued 1" in requests and "batch 2 done 17" in requests
        assert "speculative ngram, 62% accepted tokens/step 1.80" in requests
        cache = _text(screen.query_one(CachePanel))
        assert "reused 7500 prompt tokens computed 2500" in cache
        assert "hit rate 75.0%" in cache
        assert "3 in memory 50.3 MB 5 on disk 83.9 MB" in cache  # 48 and 80 MiB, in decimal units
        assert "conversations 3 kept of 5 41.9 MB" in cache
        assert "memory 3.2 GB / 38.7 GB peak 4.3 GB" in cache
        assert "engine running 4b at http://127.0.0.1:" in _text(screen.query_one("#live-status"))


async def test_stopping_the_engine_stops_polling(make_app, messages) -> None:
    app = make_app()
    async with app.run_test(size=(80, 24), message_hook=messages.append) as pilot:
        await settle(pilot)
        await pilot.press("s")
        await wait_until(pilot, lambda: len(of_type(messages, StatsPolled)) >= 1)
        await pilot.press("s")
        await wait_until(pilot, lambda: app.engine_status == "stopped")
        polled = len(of_type(messages, StatsPolled))
        await pilot.pause(0.7)  # longer than one poll interval
        assert len(of_type(messages, StatsPolled)) == polled
        assert app.engine_stats is None


@pytest.mark.parametrize(
    ("rate", "per_step", "shown"),
    [
        (0.625, 1.8, "62% accepted"),
        (0.0, 1.0, "0% accepted"),
        (0.0, 1.6, "acceptance not reported"),
    ],
)
def test_acceptance_is_never_a_made_up_zero(rate: float, per_step: float, shown: str) -> None:
    from dataclasses import replace

    from kapitsa.tui.widgets.requests_panel import _acceptance

    stats = replace(BUSY_STATS, draft_acceptance_rate=rate, tokens_per_step=per_step)
    assert _acceptance(stats) == shown
