"""The machine summary from `kapitsa doctor`: chip, usable memory, backend, recommendation, warnings."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.widgets import Static

from kapitsa.units import format_bytes


class DoctorPanel(Static):
    """Shows a doctor report, or says why there is none."""

    def on_mount(self) -> None:
        self.border_title = "This machine"
        self.update("checking this machine…")

    def show_report(self, report: Any) -> None:
        hw = report.hardware
        text = Text()
        text.append(f"{hw.chip}\n", style="bold")
        text.append(
            f"{format_bytes(hw.usable_memory_bytes)} usable of {format_bytes(hw.total_memory_bytes)}\n"
        )
        text.append(f"{hw.backend} · mlx {hw.mlx_version or 'not installed'}\n")
        text.append("recommended: ")
        text.append(
            report.recommended or "none fits", style="bold green" if report.recommended else "bold red"
        )
        for warning in report.warnings:
            text.append(f"\n! {warning}", style="yellow")
        text.no_wrap, text.overflow = (
            True,
            "ellipsis",
        )  # one line per warning; `kapitsa doctor` has them in full
        self.update(text)

    def show_error(self, message: str) -> None:
        self.update(Text(f"doctor unavailable: {message}", style="yellow"))
