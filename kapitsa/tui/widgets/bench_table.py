"""Bench results: one row per headline metric, one column per engine, figures right-aligned as in the CLI."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import DataTable

from kapitsa.bench.render import table_rows
from kapitsa.bench.schema import BenchReport


class BenchTable(DataTable):
    def on_mount(self) -> None:
        self.border_title = "Results"
        self.cursor_type = "row"

    def show(self, report: BenchReport) -> None:
        self.clear(columns=True)
        (metric, *engines), *rows = table_rows(report)
        self.add_columns(metric, *[Text(name, justify="right") for name in engines])
        for label, *cells in rows:
            self.add_row(label, *[Text(cell, justify="right") for cell in cells])
