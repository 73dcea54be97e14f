"""A model's weights, context and verdict, and the machine's memory, read the same in `kapitsa doctor`
and in the TUI: one formatter (`kapitsa.units`), decimal GB and MB."""

from __future__ import annotations

import re

from tui_support import FakeServices, settle

from kapitsa.doctor import RECORDED_PROFILES, DoctorReport, ModelFit
from kapitsa.doctor_render import render_report
from kapitsa.tui.app import KapitsaApp
from kapitsa.tui.widgets.model_table import ModelTable

FITS = (
    ModelFit("demo", "demo", "kapitsa demo", None, None, 12_000_000, 32768, "fits"),
    ModelFit(
        "4b", "4b", "Qwen3.5 4B", "4bit", "mlx-community/Qwen3.5-4B-4bit", 2_800_000_000, 262144, "fits"
    ),
    ModelFit(
        "bolt", "bolt", "Nemotron Bolt", "4bit", "nvidia/bolt", 70_000_000_000, 0, "too_big", estimated=True
    ),
)
REPORT = DoctorReport(RECORDED_PROFILES["m4-pro-48gb"], FITS, recommended="4b")


class FixedReport(FakeServices):
    def doctor_report(self):
        return REPORT


async def test_the_model_table_and_the_cli_show_the_same_cells(tmp_path) -> None:
    cli_lines = render_report(REPORT).splitlines()
    async with KapitsaApp(FixedReport(tmp_path)).run_test(size=(160, 48)) as pilot:
        await settle(pilot)
        table = pilot.app.screen.query_one(ModelTable)
        for fit in FITS:
            ref, verdict, context, weights = (str(cell) for cell in table.get_row(fit.ref)[:4])
            cli_line = next(line for line in cli_lines if line.startswith(f"{ref} "))
            cells = (re.escape(c) for c in (ref, weights, context, verdict))
            assert re.fullmatch(r"\s+".join(cells), cli_line.strip()), (cli_line, weights, context, verdict)
    assert table.get_row("demo")[3] == "12.0 MB"  # a few MB, not "0.0 GB"
    assert table.get_row("bolt")[3] == "~70.0 GB"


async def test_the_doctor_panel_and_the_cli_show_the_same_memory(tmp_path) -> None:
    memory_line = next(line for line in render_report(REPORT).splitlines() if line.startswith("Memory"))
    async with KapitsaApp(FixedReport(tmp_path)).run_test(size=(160, 48)) as pilot:
        await settle(pilot)
        panel = str(pilot.app.screen.query_one("#doctor").render())
    usable, total = re.search(r"([\d.]+ [kMGT]?B) usable of ([\d.]+ [kMGT]?B)", panel).groups()
    assert f"{total} total, {usable} usable" in memory_line
    assert (usable, total) == ("38.7 GB", "51.5 GB")  # 36 GiB of 48 GiB, in decimal GB
