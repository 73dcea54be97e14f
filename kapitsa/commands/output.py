"""What the command bodies share for rendering: stderr notes, the terminal-or-pipe choice, JSON on stdout."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console


def note(message: str) -> None:
    """A diagnostic line on stderr (stdout is for results)."""
    print(message, file=sys.stderr)


def terminal_console() -> Console | None:
    """A rich Console on stdout when it is a terminal; None when piped, so scripts get plain text."""
    if not sys.stdout.isatty():
        return None
    from rich.console import Console

    return Console()


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=_json_default))


def _json_default(value: Any) -> Any:
    return str(value) if isinstance(value, Path) else repr(value)
