"""Human-readable bench tables: one row per metric, one column per engine (side by side)."""

from __future__ import annotations

from kapitsa.bench.schema import BenchReport, EngineResult, Metric

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


def format_metric(value: Metric) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, int):
        return str(value)
    return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"


def cell(engine: EngineResult, workload: str, metric: str) -> str:
    result = engine.workload(workload)
    if result is None:
        return "-"
    if result.status != "ok":
        return result.status
    return format_metric(result.metrics.get(metric))


def table_rows(report: BenchReport) -> list[list[str]]:
    """Header row then one row per headline metric."""
    header = ["metric", *[_engine_label(e) for e in report.engines]]
    rows = [[label, *[cell(e, w, m) for e in report.engines]] for w, m, label in HEADLINE]
    return [header, *rows]


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
    return "\n".join([_machine_line(report), "", *lines, *_notes(report)])


def _engine_label(engine: EngineResult) -> str:
    return (
        f"{engine.name} ({engine.model})" if engine.model and engine.model not in engine.name else engine.name
    )


def _machine_line(report: BenchReport) -> str:
    m = report.machine
    memory = f"{m['memory_bytes'] / 2**30:.0f} GiB" if m.get("memory_bytes") else "? GiB"
    return f"{m.get('chip') or m.get('arch')} · {m.get('cpu_count')} cores · {memory} · {m.get('os')} · mlx {m.get('mlx')} ({m.get('mlx_backend')})"


def _notes(report: BenchReport) -> list[str]:
    notes = [
        f"{e.name}: {w.name} {w.status}: {w.note}"
        for e in report.engines
        for w in e.workloads
        if w.note and w.status != "ok"
    ]
    return ["", *notes] if notes else []
