"""Downloads in progress: one labelled progress bar per model; hidden when there are none."""

from __future__ import annotations

from textual.containers import Horizontal, Vertical
from textual.widgets import Label, ProgressBar

from kapitsa.units import format_bytes


class DownloadsPanel(Vertical):
    """Rows keyed by model ref. `x` on the home screen cancels the highlighted model's download."""

    def on_mount(self) -> None:
        self.border_title = "Downloads"
        self.display = False

    def _row_id(self, ref: str) -> str:
        return "dl-" + "".join(c if c.isalnum() else "_" for c in ref)

    def start(self, ref: str) -> None:
        if self.query(f"#{self._row_id(ref)}"):
            self.query_one(f"#{self._row_id(ref)}").remove()
        row = Horizontal(
            Label(ref, classes="dl-name"),
            ProgressBar(show_eta=False, classes="dl-bar"),
            Label("starting…", classes="dl-status"),
            id=self._row_id(ref),
            classes="dl-row",
        )
        self.mount(row)
        self.display = True

    def progress(self, ref: str, done: int, total: int) -> None:
        rows = self.query(f"#{self._row_id(ref)}")
        if not rows:
            return
        row = rows.first()
        row.query_one(ProgressBar).update(total=max(total, 1), progress=done)
        row.query_one(".dl-status", Label).update(f"{format_bytes(done)} / {format_bytes(total)}")

    def finish(self, ref: str, status: str) -> None:
        rows = self.query(f"#{self._row_id(ref)}")
        if rows:
            rows.first().query_one(".dl-status", Label).update(status)
