"""Home: this machine, the models that fit it, downloads, and the engine with its endpoint."""

from __future__ import annotations

import threading
import time
from functools import partial

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header

from kapitsa.tui.messages import (
    DoctorFailed,
    DoctorLoaded,
    DownloadCancelled,
    DownloadFailed,
    DownloadFinished,
    DownloadProgressed,
)
from kapitsa.tui.services import DownloadCancelledError, Unavailable
from kapitsa.tui.widgets.doctor_panel import DoctorPanel
from kapitsa.tui.widgets.downloads_panel import DownloadsPanel
from kapitsa.tui.widgets.engine_panel import EnginePanel
from kapitsa.tui.widgets.env_panel import EnvPanel
from kapitsa.tui.widgets.model_table import ModelTable

PROGRESS_INTERVAL_S = 0.2  # at most five progress messages a second per download


class HomeScreen(Screen):
    BINDINGS = [
        Binding("d", "download", "Download"),
        Binding("x", "cancel_download", "Cancel download", show=False),
        Binding("c", "copy_env", "Copy env", show=False),
        Binding("r", "refresh", "Recheck", show=False),
    ]

    def __init__(self) -> None:
        super().__init__(id="home")
        self.cancel_events: dict[str, threading.Event] = {}  # ref → set it to cancel that download
        self.downloaded: frozenset[str] = frozenset()

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="home-top"):
            yield DoctorPanel(id="doctor")
            yield EnginePanel(id="engine")
        yield EnvPanel(id="env")
        yield ModelTable(id="models")
        yield DownloadsPanel(id="downloads")
        yield Footer()

    @property
    def model_table(self) -> ModelTable:
        return self.query_one(ModelTable)

    @property
    def engine_panel(self) -> EnginePanel:
        return self.query_one(EnginePanel)

    def on_mount(self) -> None:
        self.title = "kapitsa"
        self.sub_title = "home"
        self.load_doctor()
        self.watch(self.app, "engine_status", self.show_engine, init=True)

    @work(thread=True, exclusive=True, group="doctor", exit_on_error=False)
    def load_doctor(self) -> None:
        services = self.app.services
        try:
            report = services.doctor_report()
        except Exception as err:  # noqa: BLE001 - shown on screen, never a crash
            self.post_message(DoctorFailed(err))
            return
        try:
            downloaded = services.downloaded_refs(report)
        except Unavailable:
            downloaded = frozenset()
        self.post_message(DoctorLoaded(report, downloaded))

    def on_doctor_loaded(self, message: DoctorLoaded) -> None:
        self.downloaded = message.downloaded_refs
        self.query_one(DoctorPanel).show_report(message.report)
        self.model_table.load(message.report.models, self.downloaded, select=self.app.selected_ref)
        self.model_table.focus()

    def on_doctor_failed(self, message: DoctorFailed) -> None:
        self.query_one(DoctorPanel).show_error(str(message.error))

    @on(DataTable.RowHighlighted, "#models")
    def remember_selection(self, event: DataTable.RowHighlighted) -> None:
        self.app.selected_ref = str(event.row_key.value)

    def show_engine(self, status: str) -> None:
        handle = self.app.engine_handle
        env_panel = self.query_one(EnvPanel)
        if status != "running" or handle is None:
            self.engine_panel.show(
                status,
                model=handle.model if handle else self.app.engine_model,
                note=self.app.engine_note if status == "failed" else None,
            )
            env_panel.hide()
            return
        self.engine_panel.show(status, model=handle.model, url=handle.url)
        try:
            env_panel.show_lines(self.app.services.env_lines(handle))
        except Unavailable as err:
            env_panel.show_lines([], note=str(err))

    def action_refresh(self) -> None:
        self.load_doctor()

    def action_copy_env(self) -> None:
        handle = self.app.engine_handle
        if handle is None:
            self.notify("the engine is not running: nothing to copy yet", severity="warning")
            return
        try:
            lines = self.app.services.env_lines(handle)
        except Unavailable:
            lines = []
        self.app.copy_to_clipboard("\n".join([f"{handle.url}/v1", *lines]))
        self.notify("endpoint and env lines copied to the clipboard")

    def action_download(self) -> None:
        ref = self.model_table.selected_ref
        if ref is None:
            return
        if ref in self.cancel_events:
            self.notify(f"{ref} is already downloading")
            return
        if ref in self.downloaded:
            self.notify(f"{ref} is already on this machine")
            return
        self.cancel_events[ref] = cancelled = threading.Event()
        self.query_one(DownloadsPanel).start(ref)
        self.run_worker(
            partial(self._download, ref, cancelled),
            thread=True,
            group="download",
            name=f"download {ref}",
            exit_on_error=False,
        )

    def _download(self, ref: str, cancelled: threading.Event) -> None:
        last_post = 0.0

        def on_progress(done: int, total: int) -> None:
            nonlocal last_post
            if time.monotonic() - last_post >= PROGRESS_INTERVAL_S or done >= total:
                last_post = time.monotonic()
                self.post_message(DownloadProgressed(ref, done, total))

        try:
            path = self.app.services.download(ref, on_progress=on_progress, cancelled=cancelled)
        except DownloadCancelledError:
            self.post_message(DownloadCancelled(ref))
        except Exception as err:  # noqa: BLE001 - reported in a modal
            self.post_message(DownloadFailed(ref, err))
        else:
            self.post_message(DownloadFinished(ref, path))

    def action_cancel_download(self) -> None:
        ref = self.model_table.selected_ref
        event = self.cancel_events.get(ref or "")
        if event is None:
            self.notify(f"no download of {ref} to cancel", severity="warning")
            return
        event.set()

    def on_download_progressed(self, message: DownloadProgressed) -> None:
        self.query_one(DownloadsPanel).progress(message.ref, message.bytes_done, message.bytes_total)

    def on_download_finished(self, message: DownloadFinished) -> None:
        self.cancel_events.pop(message.ref, None)
        self.downloaded = self.downloaded | {message.ref}
        self.query_one(DownloadsPanel).finish(message.ref, "done")
        self.model_table.mark_downloaded(message.ref)
        self.notify(f"{message.ref} downloaded")

    def on_download_cancelled(self, message: DownloadCancelled) -> None:
        self.cancel_events.pop(message.ref, None)
        self.query_one(DownloadsPanel).finish(message.ref, "cancelled (d resumes)")

    def on_download_failed(self, message: DownloadFailed) -> None:
        self.cancel_events.pop(message.ref, None)
        self.query_one(DownloadsPanel).fail(message.ref, message.error)
        self.app.show_error(f"Download of {message.ref} failed", message.error)
