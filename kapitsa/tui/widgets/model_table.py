"""The catalog models with fit badges (fits / tight / too big), max context and whether they are on disk."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.widgets import DataTable

from kapitsa.tui.widgets.formatting import human_bytes, human_context

BADGES = {
    "fits": ("fits", "bold green"),
    "tight": ("tight", "bold yellow"),
    "too_big": ("too big", "bold red"),
    "unavailable": ("unavailable", "dim"),
}


class ModelTable(DataTable):
    """One row per model ref; the row key is the ref to pass to `--model`."""

    def on_mount(self) -> None:
        self.border_title = "Models"
        self.cursor_type = "row"
        self.zebra_stripes = True
        self.add_columns("model", "name", "weights", "fit", "max ctx", "on disk")

    def load(self, fits: tuple[Any, ...], downloaded: frozenset[str], *, select: str | None = None) -> None:
        self.clear()
        for fit in fits:
            label, style = BADGES.get(fit.verdict, (fit.verdict, ""))
            approx = "~" if fit.estimated else ""
            self.add_row(
                fit.ref,
                fit.name,
                f"{approx}{human_bytes(fit.weights_bytes)}",
                Text(label, style=style),
                human_context(fit.max_context),
                "yes" if fit.ref in downloaded else "-",
                key=fit.ref,
            )
        refs = [fit.ref for fit in fits]
        if select in refs:
            self.move_cursor(row=refs.index(select))

    def mark_downloaded(self, ref: str) -> None:
        if ref in self.rows:
            self.update_cell(ref, self.ordered_columns[-1].key, "yes")

    @property
    def selected_ref(self) -> str | None:
        if not self.row_count:
            return None
        return str(self.coordinate_to_cell_key(self.cursor_coordinate).row_key.value)
