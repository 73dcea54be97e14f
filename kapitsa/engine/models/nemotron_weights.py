"""Checkpoint tensor renaming for Nemotron-H (`Model.sanitize`).

Accepts the published names (`backbone.*`, per-expert `experts.{e}.up_proj.weight`, `[C, 1, K]`
conv weights), transformers-5 native names (`model.*`, 3-D `experts.up_proj`) and MLX names
(already converted). Returns (weights to load, `mtp.*` weights kept aside).
"""

from __future__ import annotations

import mlx.core as mx

from kapitsa.engine.models.base import require


def _canonical(key: str) -> str:
    if key.startswith("model."):
        return "backbone." + key[len("model.") :]
    return key


def _stack_experts(w: dict[str, mx.array], num_experts: int) -> None:
    """`mixer.experts.{e}.{up,down}_proj.weight` or 3-D `mixer.experts.{up,down}_proj` ->
    `mixer.switch_mlp.{fc1,fc2}.weight` `[E, out, in]`."""
    prefixes = {k[: k.index(".experts.")] for k in w if ".experts." in k}
    for p in sorted(prefixes):
        for name, fc in (("up_proj", "fc1"), ("down_proj", "fc2")):
            stacked = f"{p}.experts.{name}"
            if stacked in w:
                w[f"{p}.switch_mlp.{fc}.weight"] = w.pop(stacked)
                continue
            keys = [f"{p}.experts.{e}.{name}.weight" for e in range(num_experts)]
            missing = [k for k in keys if k not in w]
            require(not missing, f"checkpoint lacks expert tensors, e.g. {missing[:1]}")
            w[f"{p}.switch_mlp.{fc}.weight"] = mx.stack([w.pop(k) for k in keys])


def sanitize_nemotron(weights: dict[str, mx.array], args) -> tuple[dict[str, mx.array], dict[str, mx.array]]:
    w = {_canonical(k): v for k, v in weights.items()}
    _stack_experts(w, args.n_routed_experts)
    for k, v in list(w.items()):
        if k.endswith("conv1d.weight") and v.shape[-1] != 1:
            w[k] = v.moveaxis(2, 1)  # [C, 1, K] -> MLX [C, K, 1]
    if args.tie_word_embeddings:
        w.pop("lm_head.weight", None)
    mtp = {k: w.pop(k) for k in [k for k in w if k.startswith("mtp.")]}
    return w, mtp
