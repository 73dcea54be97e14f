"""`kapitsa doctor`: this machine's GPU and memory, and which catalog models fit with how much context."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from kapitsa.catalog import load_catalog
from kapitsa.commands.group import join_as_rank, launched_rank, leave, relaunch, wants_group
from kapitsa.commands.output import print_json, terminal_console
from kapitsa.settings import load_settings

if TYPE_CHECKING:
    from kapitsa.doctor import DoctorReport


def cmd_doctor(json_out: bool, *, hostfile: Path | None = None, parallel: str = "pipeline") -> None:
    from kapitsa.doctor import build_report, probe_hardware

    settings = load_settings()
    if wants_group(hostfile):
        return _doctor_group(hostfile, parallel=parallel, json_out=json_out)
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


def _doctor_group(hostfile: Path | None, *, parallel: str, json_out: bool) -> None:
    """Every rank measures its memory; rank 0 prints what fits on the group (doctor_group.py)."""
    import sys

    from kapitsa.doctor import probe_hardware
    from kapitsa.doctor_group import group_fits, render_group
    from kapitsa.opener import check_group_flags, gather_over_group

    check_group_flags(parallel=parallel, speculative=None, draft=None, kv_bits=None)
    if launched_rank() is None:
        relaunch(hostfile, sys.argv[1:])
    join_as_rank()
    hardware = probe_hardware()
    rank, budgets = gather_over_group([hardware.usable_memory_bytes, hardware.total_memory_bytes])
    if rank != 0:
        leave(0)
    usable, totals = [b[0] for b in budgets], [b[1] for b in budgets]
    settings = load_settings()
    fits = group_fits(
        load_catalog(settings.catalog), usable, parallel=parallel, num_checkpoints=settings.num_checkpoints
    )
    if json_out:
        print_json(
            {
                "parallel": parallel,
                "usable_bytes": usable,
                "total_bytes": totals,
                "models": [asdict(f) for f in fits],
            }
        )
    else:
        print(render_group(usable, totals, fits, parallel=parallel))
    leave(0)
