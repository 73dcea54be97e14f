"""Checkpoint tensor renaming for Nemotron-H (`Model.sanitize`).

Accepts the published names (`backbone.*`, per-expert `experts.{e}.up_proj.weight`, `[C, 1, K]`
conv weights), transformers-5 native names (`model.*`, 3-D `experts.up_proj`) and MLX names
(already converted). Returns (weights to load, `mtp.*` weights kept aside).
"""

from __future__ import annotations

import mlx.core as mx

from kapitsa.engine.models.expert_weights import EXPERT_PARTS, stack_per_expert


def _canonical(key: str) -> str:
    if key.startswith("model."):
        return "backbone." + key[len("model.") :]
    return key


def _stack_experts(w: dict[str, mx.array], num_experts: int) -> None:
    """`mixer.experts.{e}.{up,down}_proj.{weight,scales,biases}` or 3-D `mixer.experts.{up,down}_proj`
    (bare, or with its MLX-quantized parts) -> `mixer.switch_mlp.{fc1,fc2}.*` `[E, out, in]`."""
    prefixes = {k[: k.index(".experts.")] for k in w if ".experts." in k}
    for p in sorted(prefixes):
        for name, fc in (("up_proj", "fc1"), ("down_proj", "fc2")):
            stacked = f"{p}.experts.{name}"
            if stacked in w:
                w[f"{p}.switch_mlp.{fc}.weight"] = w.pop(stacked)
                continue
            if f"{stacked}.weight" in w:
                for part in EXPERT_PARTS:
                    if f"{stacked}.{part}" in w:
                        w[f"{p}.switch_mlp.{fc}.{part}"] = w.pop(f"{stacked}.{part}")
                continue
            stack_per_expert(w, f"{p}.experts.{{e}}.{name}", f"{p}.switch_mlp.{fc}", num_experts)


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
