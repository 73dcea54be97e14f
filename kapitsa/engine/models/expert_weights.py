"""Routed experts stored one projection per expert, stacked into one `[E, out, in]` tensor per part."""

from __future__ import annotations

import mlx.core as mx

from kapitsa.engine.models.base import require

# An expert projection's stored tensors: its weight, and when stored MLX-quantized its scales and
# biases (AutoRound's MLX export writes experts one Linear each, quantized).
EXPERT_PARTS = ("weight", "scales", "biases")


def stack_per_expert(w: dict[str, mx.array], stored: str, stacked: str, num_experts: int) -> None:
    """`{stored with e}.{part}` for every expert e -> `{stacked}.{part}`, for each part the first
    expert stores; `stored` holds `{e}` where the expert's index goes."""
    parts = [p for p in EXPERT_PARTS if f"{stored.format(e=0)}.{p}" in w] or ["weight"]
    for part in parts:
        keys = [f"{stored.format(e=e)}.{part}" for e in range(num_experts)]
        missing = [k for k in keys if k not in w]
        require(not missing, f"checkpoint lacks expert tensors, e.g. {missing[:1]}")
        w[f"{stacked}.{part}"] = mx.stack([w.pop(k) for k in keys])
