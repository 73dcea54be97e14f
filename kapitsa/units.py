"""The one way kapitsa writes sizes and token counts, in the CLI and the TUI alike.

Sizes are decimal (1 GB = 10**9 bytes), as the Hugging Face hub and download tools show them, so a
model's weights read the same here as on its hub page, and weights and memory compare in one unit.
"""

from __future__ import annotations

_UNITS = (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3))


def format_bytes(num_bytes: int | None) -> str:
    """`15.4 GB`, `12.0 MB`, `512 B`; `-` for unknown. Each unit keeps one decimal.

    The unit is the largest one the value reaches after rounding, so a few-MB model never reads
    "0.0 GB" and 999,960 bytes read "1.0 MB", not "1000.0 kB".
    """
    if num_bytes is None:
        return "-"
    for unit, size in _UNITS:
        if round(num_bytes / size, 1) >= 1:
            return f"{num_bytes / size:.1f} {unit}"
    return f"{num_bytes} B"


def format_context(tokens: int | None) -> str:
    """Context lengths as model cards write them: 262144 tokens is `256K`."""
    if not tokens:
        return "-"
    return f"{tokens // 1024}K" if tokens >= 1024 else str(tokens)
