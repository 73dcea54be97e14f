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
        """Done or cancelled: the bar stops where it is and the status says why."""
        self._stop(ref, status)

    def fail(self, ref: str, error: BaseException) -> None:
        """The bar stops (in the error colour) and the row shows the error's first line; the modal has it all."""
        reason = next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)
        status = self._stop(ref, f"failed: {reason}", failed=True)
        if status is not None:
            status.tooltip = str(error)  # the whole message on hover

    def _stop(self, ref: str, status: str, *, failed: bool = False) -> Label | None:
        rows = self.query(f"#{self._row_id(ref)}")
        if not rows:
            return None
        row = rows.first()
        bar = row.query_one(ProgressBar)
        if bar.total is None:  # no byte arrived yet: an indeterminate bar would keep animating
            bar.update(total=1, progress=0)
        row.set_class(failed, "dl-failed")
        label = row.query_one(".dl-status", Label)
        label.update(status)
        return label
