"""The doctor report for people: plain text when piped, rich tables on a terminal, and the cell
strings the TUI's panels share, so a model reads the same in `kapitsa doctor` and in the TUI."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kapitsa.units import format_bytes, format_context

if TYPE_CHECKING:
    from rich.console import RenderableType

    from kapitsa.doctor import DoctorReport, HardwareProfile, ModelFit

VERDICTS: dict[str, tuple[str, str]] = {  # verdict -> (label, rich style)
    "fits": ("fits", "bold green"),
    "tight": ("tight", "bold yellow"),
    "too_big": ("too big", "bold red"),
    "unavailable": ("unavailable", "dim"),
}
ESTIMATED_NOTE = "(~: layer shapes assumed, not read from the model's config.json)"
SMALL_LEAD = "Fits only with :small (routed experts at 2 bits): "


def verdict_label(verdict: str) -> str:
    return VERDICTS.get(verdict, (verdict, ""))[0]


def weights_label(fit: ModelFit) -> str:
    """`15.4 GB`, or `~70.0 GB` when the layer shapes are assumed."""
    return ("~" if fit.estimated else "") + format_bytes(fit.weights_bytes)


def memory_line(hw: HardwareProfile) -> str:
    free_now = f", {format_bytes(hw.available_now_bytes)} free now" if hw.available_now_bytes else ""
    return (
        f"{format_bytes(hw.total_memory_bytes)} total, {format_bytes(hw.usable_memory_bytes)} usable "
        f"({hw.usable_memory_source}){free_now}"
    )


def _machine_rows(hw: HardwareProfile) -> list[tuple[str, str]]:
    return [
        ("Machine", f"{hw.chip} ({hw.machine}), {hw.os_name}"),
        ("Memory", memory_line(hw)),
        ("GPU", hw.gpu),
        ("MLX", f"{hw.mlx_version or 'not installed'} (backend: {hw.backend})"),
        ("Disk", f"{format_bytes(hw.disk_free_bytes)} free at {hw.disk_path}"),
    ]


def render_report(report: DoctorReport) -> str:
    """The plain-text report (piped output; `--json` prints `to_json_dict()` instead)."""
    lines = [f"{key:<10} {value}" for key, value in _machine_rows(report.hardware)]
    lines += ["", f"{'MODEL':<20} {'WEIGHTS':>9} {'MAX CONTEXT':>12}  VERDICT"]
    for fit in report.models:
        note = f"  {fit.note}" if fit.verdict == "unavailable" or fit.quant == "small" else ""
        lines.append(
            f"{fit.ref:<20} {weights_label(fit):>9} {format_context(fit.max_context):>12}  "
            f"{verdict_label(fit.verdict)}{note}"
        )
    lines += ["", f"Recommended: {report.recommended or 'none fits'}"]
    if report.also_small:
        lines.append(f"{SMALL_LEAD}{', '.join(report.also_small)}")
    lines += [f"warning: {w}" for w in report.warnings]
    if any(f.estimated for f in report.models):
        lines.append(ESTIMATED_NOTE)
    return "\n".join(lines)


def rich_report(report: DoctorReport) -> list[RenderableType]:
    """The same report as `render_report`, as rich renderables: a machine grid, a models table, notes."""
    from rich.table import Table
    from rich.text import Text

    machine = Table.grid(padding=(0, 2))
    machine.add_column(style="bold cyan")
    machine.add_column()
    for key, value in _machine_rows(report.hardware):
        machine.add_row(key, Text(value))
    recommended = Text("Recommended: ")
    recommended.append(
        report.recommended or "none fits", style="bold green" if report.recommended else "bold red"
    )
    notes = [Text(f"warning: {w}", style="yellow") for w in report.warnings]
    if report.also_small:
        notes.insert(0, Text(f"{SMALL_LEAD}{', '.join(report.also_small)}", style="green"))
    if any(f.estimated for f in report.models):
        notes.append(Text(ESTIMATED_NOTE, style="dim"))
    return [machine, _models_table(report.models), recommended, *notes]


def _models_table(fits: tuple[ModelFit, ...]) -> RenderableType:
    from rich.table import Table
    from rich.text import Text

    table = Table(header_style="bold")
    table.add_column("model", style="cyan", no_wrap=True)
    table.add_column("weights", justify="right")
    table.add_column("max context", justify="right")
    table.add_column("verdict")
    for fit in fits:
        label, style = VERDICTS.get(fit.verdict, (fit.verdict, ""))
        verdict = Text(label, style=style)
        if (fit.verdict == "unavailable" or fit.quant == "small") and fit.note:
            verdict.append(f"  {fit.note}", style="dim")
        table.add_row(fit.ref, weights_label(fit), format_context(fit.max_context), verdict)
    return table
