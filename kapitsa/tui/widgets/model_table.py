"""The catalog models with fit badges (fits / tight / too big), max context and whether they are on disk."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.text import Text
from textual.widgets import DataTable

from kapitsa.doctor_render import VERDICTS, weights_label
from kapitsa.units import format_context

COLUMNS = ("model", "fit", "max ctx", "weights", "on disk", "name")  # name last: it may be cut at 80 columns
ON_DISK = COLUMNS.index("on disk")


class ModelTable(DataTable):
    """One row per model ref; the row key is the ref to pass to `--model`."""

    def on_mount(self) -> None:
        self.border_title = "Models"
        self.cursor_type = "row"
        self.zebra_stripes = True
        self.add_columns(*COLUMNS)

    def load(self, fits: tuple[Any, ...], downloaded: frozenset[str], *, select: str | None = None) -> None:
        self.clear()
        refs = [fit.ref for fit in fits]
        if select and select not in refs:  # a folder or repo id from the settings: not in the catalog
            on_disk = "yes" if Path(select).expanduser().exists() else "?"
            not_rated = Text("not rated", style="dim")
            self.add_row(_short(select), not_rated, "-", "-", on_disk, "your default model", key=select)
            refs.insert(0, select)
        for fit in fits:
            self.add_row(*_cells(fit, fit.ref in downloaded), key=fit.ref)
        if select in refs:
            self.move_cursor(row=refs.index(select))

    def mark_downloaded(self, ref: str) -> None:
        if ref in self.rows:
            self.update_cell(ref, self.ordered_columns[ON_DISK].key, "yes")

    @property
    def selected_ref(self) -> str | None:
        if not self.row_count:
            return None
        return str(self.coordinate_to_cell_key(self.cursor_coordinate).row_key.value)


def _cells(fit: Any, downloaded: bool) -> tuple[object, ...]:
    label, style = VERDICTS.get(fit.verdict, (fit.verdict, ""))
    return (
        fit.ref,
        Text(label, style=style),
        format_context(fit.max_context),
        weights_label(fit),
        "yes" if downloaded else "-",
        _name(fit),
    )


def _name(fit: Any) -> Text:
    """The model's name; vision-language models say they read images."""
    if not getattr(fit, "takes_images", False):
        return Text(fit.name)
    return Text.assemble(fit.name, (" · images", "cyan"))


def _short(ref: str, width: int = 24) -> str:
    name = Path(ref).name if "/" in ref and Path(ref).expanduser().exists() else ref
    return name if len(name) <= width else "…" + name[-(width - 1) :]
