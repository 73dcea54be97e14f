"""Bench results: one row per headline metric, one column per engine."""

from __future__ import annotations

from textual.widgets import DataTable

from kapitsa.bench.render import table_rows
from kapitsa.bench.schema import BenchReport


class BenchTable(DataTable):
    def on_mount(self) -> None:
        self.border_title = "Results"
        self.cursor_type = "row"

    def show(self, report: BenchReport) -> None:
        self.clear(columns=True)
        header, *rows = table_rows(report)
        self.add_columns(*header)
        for row in rows:
            self.add_row(*row)
