"""Bench screen: runs the workloads over HTTP against the running engine, shows the table, submits after a confirm."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from textual.widgets import TextArea
from tui_support import of_type, settle, wait_until

from kapitsa.tui.messages import BenchFinished, BenchProgressed, SubmitFinished
from kapitsa.tui.screens.confirm_submit import ConfirmSubmitModal
from kapitsa.tui.screens.error import ErrorModal
from kapitsa.tui.widgets.bench_table import BenchTable

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
from results_receiver import Receiver  # noqa: E402


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


async def _run_quick_bench(pilot, messages) -> None:
    await settle(pilot)
    await pilot.press("s")
    await wait_until(pilot, lambda: pilot.app.engine_status == "running")
    await pilot.press("3", "r")
    await wait_until(pilot, lambda: bool(of_type(messages, BenchFinished)), timeout_s=30)
    await pilot.pause()


async def test_quick_bench_fills_the_table(make_app, messages) -> None:
    app = make_app()
    async with app.run_test(size=(80, 24), message_hook=messages.append) as pilot:
        await _run_quick_bench(pilot, messages)
        assert [m.workload for m in of_type(messages, BenchProgressed)][:2] == ["decode_short", "decode_long"]
        (finished,) = of_type(messages, BenchFinished)
        engine = finished.report.engines[0]
        assert engine.kind == "http" and engine.url == f"{app.engine_handle.url}/v1" and engine.model == "4b"
        assert engine.speculative == "ngram"  # read from EngineClient.stats(), which HTTP alone cannot say
        assert finished.path.exists()
        table = app.screen.query_one(BenchTable)
        assert table.row_count == 8 and str(table.get_row_at(0)[0]) == "decode tok/s (short prompt)"
        assert "saved" in str(app.screen.query_one("#bench-status").render())


async def test_submit_shows_the_json_and_posts_on_yes(make_app, messages, receiver, monkeypatch) -> None:
    monkeypatch.setenv("KAPITSA_BENCH_RESULTS_URL", receiver.url)
    app = make_app()
    async with app.run_test(size=(80, 24), message_hook=messages.append) as pilot:
        await _run_quick_bench(pilot, messages)
        await pilot.press("u")
        assert isinstance(app.screen, ConfirmSubmitModal)
        shown = json.loads(app.screen.query_one(TextArea).text)
        assert shown["schema"] == "kapitsa-bench"
        await pilot.press("y")
        await settle(pilot)
        (submitted,) = of_type(messages, SubmitFinished)
        assert submitted.result.posted and receiver.received == [shown]


async def test_submit_declined_posts_nothing(make_app, messages, receiver, monkeypatch) -> None:
    monkeypatch.setenv("KAPITSA_BENCH_RESULTS_URL", receiver.url)
    app = make_app()
    async with app.run_test(size=(80, 24), message_hook=messages.append) as pilot:
        await _run_quick_bench(pilot, messages)
        await pilot.press("u", "n")
        await settle(pilot)
        assert receiver.received == [] and not of_type(messages, SubmitFinished)
        assert "not submitted" in str(app.screen.query_one("#bench-status").render())


async def test_bench_without_engine_or_results_is_a_modal(make_app) -> None:
    app = make_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        await pilot.press("3", "r")
        assert isinstance(app.screen, ErrorModal) and "start it first" in app.screen.message
        await pilot.press("enter", "u")
        assert isinstance(app.screen, ErrorModal) and "run a bench first" in app.screen.message


async def test_rows_fill_as_workloads_finish_with_an_eta(make_app, messages, monkeypatch) -> None:
    """Partial results: after two workloads their rows show figures, the rest wait, the status has an ETA."""
    import asyncio

    from kapitsa.bench.schema import EngineResult, WorkloadResult
    from kapitsa.tui.screens import bench as bench_screen

    release = asyncio.Event()

    async def two_then_wait(target, config, *, on_progress, on_result):
        for index, (name, rate) in enumerate([("decode_short", 12.5), ("decode_long", 9.214)]):
            on_progress(name, index, 7)
            on_result(WorkloadResult(name, metrics={"decode_tok_s": rate}), index, 7)
        on_progress("prefill", 2, 7)
        await release.wait()
        return EngineResult(name="kapitsa", kind="http", model="4b")

    monkeypatch.setattr(bench_screen, "run_bench", two_then_wait)
    app = make_app()
    async with app.run_test(size=(80, 24), message_hook=messages.append) as pilot:
        await settle(pilot)
        await pilot.press("s")
        await wait_until(pilot, lambda: pilot.app.engine_status == "running")
        await pilot.press("3", "r")
        status = app.screen.query_one("#bench-status")
        await wait_until(pilot, lambda: "3/7: prefill" in str(status.render()))
        table = app.screen.query_one(BenchTable)
        assert [str(c) for c in table.get_row_at(0)][1:] == ["12.5"]
        assert [str(c) for c in table.get_row_at(1)][1:] == ["9.2"]
        assert [str(c) for c in table.get_row_at(2)][1:] == ["-"]
        assert re.search(r"ETA \d+s", str(status.render()))
        release.set()
        await wait_until(pilot, lambda: bool(of_type(messages, BenchFinished)))
