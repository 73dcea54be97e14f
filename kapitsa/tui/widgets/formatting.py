"""Number formatters only the panels use; sizes and context lengths come from `kapitsa.units`."""

from __future__ import annotations


def rate(value: float) -> str:
    return f"{value:,.1f}" if value < 1000 else f"{value:,.0f}"
