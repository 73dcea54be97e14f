"""`GET /metrics`: `EngineStats` as Prometheus text exposition (format 0.0.4)."""

from __future__ import annotations

from dataclasses import fields

from kapitsa.engine.types import EngineStats

_COUNTERS = {
    "prompt_tokens_cached",
    "prompt_tokens_computed",
    "generated_tokens",
    "requests_finished",
    "requests_failed",
    "requests_sent_back",
    "checkpoints_loaded_from_disk",
    "checkpoints_preloaded",
    "checkpoints_read_ahead",
    "speculative_verifies",
    "draft_tokens_proposed",
    "draft_tokens_accepted",
    "speculative_pipeline_exits",
}


def prometheus_text(stats: EngineStats) -> str:
    lines: list[str] = []
    for field in fields(stats):
        value = getattr(stats, field.name)
        if isinstance(value, bool):
            value = int(value)
        if not isinstance(value, (int, float)):
            continue
        name = f"kapitsa_{field.name}" + ("_total" if field.name in _COUNTERS else "")
        kind = "counter" if field.name in _COUNTERS else "gauge"
        lines += [f"# TYPE {name} {kind}", f"{name} {value}"]
    lines += ["# TYPE kapitsa_cache_hit_rate gauge", f"kapitsa_cache_hit_rate {stats.cache_hit_rate}"]
    model = (stats.model or "").replace("\\", "\\\\").replace('"', '\\"')
    lines += [
        "# TYPE kapitsa_info gauge",
        f'kapitsa_info{{model="{model}",speculative="{stats.speculative}"}} 1',
    ]
    return "\n".join(lines) + "\n"
