"""`kapitsa doctor`: this machine's GPU and memory, and which catalog models fit with how much context."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kapitsa.catalog import load_catalog
from kapitsa.commands.output import print_json, terminal_console
from kapitsa.settings import load_settings

if TYPE_CHECKING:
    from kapitsa.doctor import DoctorReport


def cmd_doctor(json_out: bool) -> None:
    from kapitsa.doctor import build_report, probe_hardware

    settings = load_settings()
    report = build_report(
        probe_hardware(), load_catalog(settings.catalog), num_checkpoints=settings.num_checkpoints
    )
    print_doctor(report, json_out=json_out)


def print_doctor(report: DoctorReport, *, json_out: bool) -> None:
    """JSON for `--json`; rich tables in colour on a terminal; the plain report when piped."""
    from kapitsa.doctor_render import render_report, rich_report

    if json_out:
        print_json(report.to_json_dict())
    elif (console := terminal_console()) is not None:
        for part in rich_report(report):
            console.print(part)
    else:
        print(render_report(report))
