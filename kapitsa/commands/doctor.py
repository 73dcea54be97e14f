"""`kapitsa doctor`: this machine's GPU and memory, and which catalog models fit with how much context."""

from __future__ import annotations

from kapitsa.catalog import load_catalog
from kapitsa.commands.output import print_json
from kapitsa.settings import load_settings


def cmd_doctor(json_out: bool) -> None:
    from kapitsa.doctor import build_report, probe_hardware, render_report

    settings = load_settings()
    report = build_report(
        probe_hardware(), load_catalog(settings.catalog), num_checkpoints=settings.num_checkpoints
    )
    if json_out:
        print_json(report.to_json_dict())
    else:
        print(render_report(report))
