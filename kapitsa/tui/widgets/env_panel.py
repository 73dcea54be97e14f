"""The endpoint's `env` lines, full width so they never wrap, ready to copy (`c`)."""

from __future__ import annotations

from textual.widgets import Static


class EnvPanel(Static):
    """Hidden until the engine runs."""

    def on_mount(self) -> None:
        self.border_title = "Environment (c copies)"
        self.display = False

    def show_lines(self, lines: list[str], *, note: str | None = None) -> None:
        shown = [line for line in lines if not line.startswith("#")]  # comments are copied, not shown
        self.update("\n".join([*shown, *([note] if note else [])]))
        self.display = True

    def hide(self) -> None:
        self.display = False
