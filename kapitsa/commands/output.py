"""What the command bodies share for rendering: stderr notes, sizes, JSON on stdout."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def note(message: str) -> None:
    """A diagnostic line on stderr (stdout is for results)."""
    print(message, file=sys.stderr)


def gigabytes(num_bytes: int) -> str:
    return f"{num_bytes / 1e9:.2f} GB"


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=_json_default))


def _json_default(value: Any) -> Any:
    return str(value) if isinstance(value, Path) else repr(value)
