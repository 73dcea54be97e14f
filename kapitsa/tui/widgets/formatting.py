"""Small number formatters shared by the panels."""

from __future__ import annotations


def human_bytes(num_bytes: int | None) -> str:
    if num_bytes is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= size:
            return f"{num_bytes / size:.1f} {unit}"
    return f"{num_bytes} B"


def human_context(tokens: int | None) -> str:
    if not tokens:
        return "-"
    return f"{tokens // 1024}K" if tokens >= 1024 else str(tokens)


def rate(value: float) -> str:
    return f"{value:,.1f}" if value < 1000 else f"{value:,.0f}"
