"""Bench tables: one row per metric, one column per engine (side by side), plain or rich.

Each metric has one precision wherever it is shown (CLI table, TUI table, partial-result lines):
rates (tok/s) and percentages with 1 decimal, seconds and ratios with 2, counts as integers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kapitsa.bench.schema import WORKLOAD_METRICS, BenchReport, EngineResult, Metric, WorkloadResult
from kapitsa.units import format_bytes

if TYPE_CHECKING:
    from rich.table import Table
    from rich.text import Text

# The headline metrics shown in tables; `--json` has them all.
HEADLINE: tuple[tuple[str, str, str], ...] = (
    ("decode_short", "decode_tok_s", "decode tok/s (short prompt)"),
    ("decode_long", "decode_tok_s", "decode tok/s (long prompt)"),
    ("prefill", "prefill_tok_s", "prefill tok/s"),
    ("ttft_cold_warm", "ttft_cold_s", "TTFT cold (s)"),
    ("ttft_cold_warm", "ttft_warm_s", "TTFT warm (s)"),
    ("agent_replay", "cache_hit_pct", "agent replay cache hit %"),
    ("concurrent_4", "aggregate_tok_s", "4 streams aggregate tok/s"),
    ("speculative", "acceptance_pct", "speculative acceptance %"),
)

_RATIO_METRICS = frozenset({"warm_speedup"})
_CELL_STYLES = {"error": "bold red", "skipped": "yellow", "n/a": "dim", "-": "dim"}


def metric_decimals(metric: str) -> int:
    """Decimals for one metric key: 1 for tok/s and %, 2 for seconds and ratios."""
    if metric.endswith("_tok_s") or metric.endswith("_pct"):
        return 1
    if metric.endswith("_s") or metric in _RATIO_METRICS:
        return 2
    return 0


def format_metric(metric: str, value: Metric) -> str:
    if value is None:
        return "n/a"
    decimals = metric_decimals(metric)
    if isinstance(value, int) and decimals == 0:
        return str(value)
    return f"{value:.{decimals}f}"


def cell(engine: EngineResult, workload: str, metric: str) -> str:
    result = engine.workload(workload)
    if result is None:
        return "-"
    if result.status != "ok":
        return result.status
    return format_metric(metric, result.metrics.get(metric))


def table_rows(report: BenchReport) -> list[list[str]]:
    """Header row then one row per headline metric of the report's workloads (`bench --workload`
    picks them; a report that does not say has them all), a row of "-" until a workload runs."""
    header = ["metric", *[_engine_label(e) for e in report.engines]]
    chosen = report.config.get("workloads") or [w for w, _, _ in HEADLINE]
    rows = [[label, *[cell(e, w, m) for e in report.engines]] for w, m, label in HEADLINE if w in chosen]
    return [header, *rows]


def workload_line(engine_name: str, result: WorkloadResult) -> str:
    """One finished workload's figures on one line (the partial results shown while a bench runs)."""
    if result.status != "ok":
        return f"[{engine_name}] {result.name}: {result.status}" + (
            f" ({result.note})" if result.note else ""
        )
    figures = [
        f"{key}={format_metric(key, result.metrics.get(key))}"
        for key in WORKLOAD_METRICS.get(result.name, tuple(result.metrics))
        if key in result.metrics
    ]
    return f"[{engine_name}] {result.name}: " + " ".join(figures)


def render_text(report: BenchReport) -> str:
    rows = table_rows(report)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join([machine_line(report), "", *lines, *_notes(report)])


def rich_table(report: BenchReport) -> Table:
    """The same rows as `render_text`, as a rich Table: figures right-aligned, failures in colour."""
    from rich.table import Table
    from rich.text import Text

    header, *rows = table_rows(report)
    table = Table(title=machine_line(report), title_justify="left", header_style="bold")
    table.add_column(header[0], style="cyan")
    for label in header[1:]:
        table.add_column(Text(label), justify="right")
    for label, *cells in rows:
        table.add_row(Text(label), *[_styled(c) for c in cells])
    return table


def notes(report: BenchReport) -> list[str]:
    return _notes(report)[1:]


def _styled(text: str) -> Text:
    from rich.text import Text

    return Text(text, style=_CELL_STYLES.get(text, ""))


def _engine_label(engine: EngineResult) -> str:
    return (
        f"{engine.name} ({engine.model})" if engine.model and engine.model not in engine.name else engine.name
    )


def machine_line(report: BenchReport) -> str:
    m = report.machine
    memory = format_bytes(m["memory_bytes"]) if m.get("memory_bytes") else "? GB"
    return f"{m.get('chip') or m.get('arch')} · {m.get('cpu_count')} cores · {memory} · {m.get('os')} · mlx {m.get('mlx')} ({m.get('mlx_backend')})"


def _notes(report: BenchReport) -> list[str]:
    notes = [
        f"{e.name}: {w.name} {w.status}: {w.note}"
        for e in report.engines
        for w in e.workloads
        if w.note and w.status != "ok"
    ]
    return ["", *notes] if notes else []
