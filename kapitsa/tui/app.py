"""The Textual app (`kapitsa` with no arguments)."""

from __future__ import annotations

from kapitsa.errors import NotBuilt


def run_tui() -> None:
    raise NotBuilt("the kapitsa TUI is not built yet in this version; try `kapitsa --help`.")
