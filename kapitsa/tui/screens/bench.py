"""Bench: run the standard workloads against the running engine, see the table, submit."""

from __future__ import annotations

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Footer, Header, Static

from kapitsa.bench.command import QUICK_CONFIG
from kapitsa.bench.machine import machine_info
from kapitsa.bench.progress import EtaClock, format_eta
from kapitsa.bench.runner import WORKLOAD_NAMES, run_bench
from kapitsa.bench.schema import BenchReport, EngineResult
from kapitsa.bench.submit import report_json, resolve_results_url, save_report, submit_report
from kapitsa.bench.targets import HttpTarget
from kapitsa.bench.workloads import BenchConfig
from kapitsa.tui.messages import (
    BenchFailed,
    BenchFinished,
    BenchProgressed,
    BenchWorkloadDone,
    SubmitFailed,
    SubmitFinished,
)
from kapitsa.tui.screens.confirm_submit import ConfirmSubmitModal
from kapitsa.tui.widgets.bench_table import BenchTable


class BenchScreen(Screen):
    BINDINGS = [
        Binding("r", "run_bench(True)", "Quick"),
        Binding("f", "run_bench(False)", "Full"),
        Binding("u", "submit", "Submit"),
    ]

    def __init__(self) -> None:
        super().__init__(id="bench")
        self.report: BenchReport | None = None
        self.report_path = None
        self.running = False
        self.partial: BenchReport | None = None  # the rows so far, while a bench runs
        self.clock = EtaClock(len(WORKLOAD_NAMES))

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static("press r for a quick bench, f for the full one", id="bench-status")
        yield BenchTable(id="bench-table")
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = "bench"

    def set_status(self, text: str) -> None:
        self.query_one("#bench-status", Static).update(text)

    def action_run_bench(self, quick: bool) -> None:
        handle = self.app.engine_handle
        if handle is None:
            self.app.show_error("Bench", "the engine is not running: start it first (s)")
            return
        if self.running:
            self.notify("a bench is already running")
            return
        self.running = True
        self.clock = EtaClock(len(WORKLOAD_NAMES))
        engine = EngineResult(name="kapitsa", kind="http", model=handle.model, url=f"{handle.url}/v1")
        self.partial = BenchReport(machine={}, config={}, engines=[engine])  # rows only, not kept
        self.query_one(BenchTable).show(self.partial)
        self.set_status(f"benching {handle.model} at {handle.url}/v1 …")
        self.run_bench_worker(handle.url, handle.client.stats, QUICK_CONFIG if quick else BenchConfig())

    @work(exclusive=True, group="bench", exit_on_error=False)
    async def run_bench_worker(self, url: str, stats, config: BenchConfig) -> None:
        target = HttpTarget(url, name="kapitsa", stats=stats)
        try:
            await target.prepare()
            result = await run_bench(
                target,
                config,
                on_progress=lambda name, i, n: self.post_message(BenchProgressed(name, i, n)),
                on_result=lambda done, i, n: self.post_message(BenchWorkloadDone(done, i, n)),
            )
            report = BenchReport(machine=machine_info(), config=config.to_dict(), engines=[result])
            self.post_message(BenchFinished(report, save_report(report)))
        except Exception as err:  # noqa: BLE001 - shown in a modal
            self.post_message(BenchFailed(err))
        finally:
            await target.aclose()

    def on_bench_progressed(self, message: BenchProgressed) -> None:
        self.clock.start()
        eta = format_eta(self.clock.eta_s())
        self.set_status(f"running {message.index + 1}/{message.total}: {message.workload}  ·  {eta}")

    def on_bench_workload_done(self, message: BenchWorkloadDone) -> None:
        """Fill the finished workload's rows now, not at the end."""
        self.clock.step_done()
        if self.partial is not None:
            self.partial.engines[0].workloads.append(message.result)
            self.query_one(BenchTable).show(self.partial)

    def on_bench_finished(self, message: BenchFinished) -> None:
        self.running, self.partial = False, None
        self.report, self.report_path = message.report, message.path
        self.query_one(BenchTable).show(message.report)
        failed = [w for e in message.report.engines for w in e.workloads if w.status == "error"]
        if failed:
            self.set_status(f"{len(failed)} workload(s) failed, first: {failed[0].name}: {failed[0].note}")
        else:
            self.set_status(f"saved {message.path}  ·  u submits")

    def on_bench_failed(self, message: BenchFailed) -> None:
        self.running, self.partial = False, None
        self.set_status("bench failed")
        self.app.show_error("Bench failed", message.error)

    def action_submit(self) -> None:
        if self.report is None:
            self.app.show_error("Submit", "there are no results yet: run a bench first (r)")
            return
        url = resolve_results_url(None)
        self.app.push_screen(
            ConfirmSubmitModal(report_json(self.report), url),
            lambda yes: self.submit_worker(url) if yes else self.set_status("not submitted"),
        )

    @work(thread=True, exclusive=True, group="submit", exit_on_error=False)
    def submit_worker(self, url: str | None) -> None:
        assert self.report is not None and self.report_path is not None
        try:
            self.post_message(SubmitFinished(submit_report(self.report, url=url, path=self.report_path)))
        except Exception as err:  # noqa: BLE001 - shown in a modal
            self.post_message(SubmitFailed(err))

    def on_submit_finished(self, message: SubmitFinished) -> None:
        self.set_status(message.result.message)

    def on_submit_failed(self, message: SubmitFailed) -> None:
        self.app.show_error("Submit failed", message.error)
