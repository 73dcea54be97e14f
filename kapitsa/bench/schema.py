"""The versioned bench report: what `--json` prints, what `--submit` posts, what files keep.

Every metric is a number or `None`; `None` means "not measured or not reported by that engine",
never zero. Bump `SCHEMA_VERSION` whenever a key changes meaning or disappears.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import asdict, dataclass, field
from typing import Any

from kapitsa import __version__
from kapitsa.errors import InvalidRequest

SCHEMA_NAME = "kapitsa-bench"
SCHEMA_VERSION = 1

Metric = float | int | None

# The metrics each workload reports, in display order. Keys are part of the schema.
WORKLOAD_METRICS: dict[str, tuple[str, ...]] = {
    "decode_short": ("decode_tok_s", "ttft_s", "prompt_tokens", "completion_tokens"),
    "decode_long": ("decode_tok_s", "ttft_s", "prompt_tokens", "completion_tokens"),
    "prefill": ("prefill_tok_s", "ttft_s", "prompt_tokens"),
    "ttft_cold_warm": ("ttft_cold_s", "ttft_warm_s", "warm_speedup", "cached_tokens_warm", "prompt_tokens"),
    "agent_replay": ("cache_hit_pct", "turns", "prompt_tokens", "cached_tokens", "mean_ttft_s"),
    "concurrent_4": ("aggregate_tok_s", "streams", "completion_tokens", "wall_s"),
    "speculative": ("acceptance_pct", "draft_tokens_proposed", "draft_tokens_accepted"),
}


@dataclass(slots=True)
class WorkloadResult:
    """One workload on one engine. `status` is "ok", "skipped" (with `note`) or "error" (with `note`)."""

    name: str
    status: str = "ok"
    metrics: dict[str, Metric] = field(default_factory=dict)
    note: str | None = None


@dataclass(slots=True)
class EngineResult:
    """All workloads run against one engine (the local one or a `--compare` URL)."""

    name: str
    kind: str  # "in-process" | "http"
    model: str | None
    url: str | None = None
    speculative: str | None = None
    workloads: list[WorkloadResult] = field(default_factory=list)

    def workload(self, name: str) -> WorkloadResult | None:
        return next((w for w in self.workloads if w.name == name), None)


@dataclass(slots=True)
class BenchReport:
    machine: dict[str, Any]
    config: dict[str, Any]
    engines: list[EngineResult] = field(default_factory=list)
    created_at: str = field(default_factory=lambda: dt.datetime.now(dt.UTC).isoformat(timespec="seconds"))
    kapitsa_version: str = __version__

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA_NAME, "schema_version": SCHEMA_VERSION, **asdict(self)}


def report_from_dict(data: Any) -> BenchReport:
    """Parse and validate a report dict (a saved file or a submission); raise `InvalidRequest`."""
    if not isinstance(data, dict) or data.get("schema") != SCHEMA_NAME:
        raise InvalidRequest(f"not a {SCHEMA_NAME} report")
    if data.get("schema_version") != SCHEMA_VERSION:
        raise InvalidRequest(
            f"unsupported schema_version {data.get('schema_version')!r} (expected {SCHEMA_VERSION})"
        )
    try:
        engines = [_engine_from_dict(e) for e in data["engines"]]
        return BenchReport(
            machine=dict(data["machine"]),
            config=dict(data["config"]),
            engines=engines,
            created_at=str(data["created_at"]),
            kapitsa_version=str(data["kapitsa_version"]),
        )
    except (KeyError, TypeError, ValueError) as err:
        raise InvalidRequest(f"malformed bench report: {err}") from err


def _engine_from_dict(data: dict[str, Any]) -> EngineResult:
    workloads = [_workload_from_dict(w) for w in data["workloads"]]
    return EngineResult(
        name=str(data["name"]),
        kind=str(data["kind"]),
        model=data.get("model"),
        url=data.get("url"),
        speculative=data.get("speculative"),
        workloads=workloads,
    )


def _workload_from_dict(data: dict[str, Any]) -> WorkloadResult:
    name = str(data["name"])
    if name not in WORKLOAD_METRICS:
        raise ValueError(f"unknown workload {name!r}")
    if data["status"] not in ("ok", "skipped", "error"):
        raise ValueError(f"bad status {data['status']!r}")
    metrics = dict(data["metrics"])
    for key, value in metrics.items():
        if key not in WORKLOAD_METRICS[name]:
            raise ValueError(f"unknown metric {name}.{key}")
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise ValueError(f"metric {name}.{key} must be a number or null")
    return WorkloadResult(name=name, status=data["status"], metrics=metrics, note=data.get("note"))
