"""Checkpoint tensor renaming for the Qwen3.5 / Qwen3-Next family (`Model.sanitize`).

Accepts Hugging Face names (`model.language_model.*` or `model.*`, per-expert or fused expert
tensors, `[C, 1, K]` conv weights, zero-centred `1 + w` RMS norms) and MLX names as mlx-lm writes
them (already converted: returned unchanged apart from the prefix), and produces this package's
parameter paths. `mtp.*` tensors are converted the same way and kept.
"""

from __future__ import annotations

import mlx.core as mx

from kapitsa.engine.models.base import require
from kapitsa.engine.models.expert_weights import EXPERT_PARTS, stack_per_expert

_DROP_PREFIXES = ("model.visual.", "visual.", "vision_tower.", "model.vision_tower.")
# RMS norms stored as `w` with output `x * (1 + w)` in Hugging Face checkpoints. The GDN output
# norm (`linear_attn.norm`) is a plain weight and is not among them.
_ZERO_CENTRED = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "q_norm.weight",
    "k_norm.weight",
    "pre_fc_norm_embedding.weight",
    "pre_fc_norm_hidden.weight",
)


def _canonical(key: str) -> str:
    """Strip the wrapper prefixes: `model.language_model.X` / `language_model.model.X` -> `model.X`."""
    for old, new in (
        ("model.language_model.", "model."),
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        ("language_model.", ""),
    ):
        if key.startswith(old):
            return new + key[len(old) :]
    return key


def _is_zero_centred(key: str) -> bool:
    return key in ("model.norm.weight", "mtp.norm.weight") or (
        key.endswith(_ZERO_CENTRED) and ".linear_attn." not in key
    )


def _stack_experts(w: dict[str, mx.array], num_experts: int) -> None:
    """`*.mlp.experts.{e}.{gate,up,down}_proj.{weight,scales,biases}` or fused
    `experts.gate_up_proj[.weight|.scales|.biases]` -> `*.mlp.switch_mlp.{gate,up,down}_proj.*`
    `[E, out, in]`."""
    prefixes = {k[: k.index(".experts.")] for k in w if ".mlp.experts." in k}
    for p in sorted(prefixes):
        if any(f"{p}.experts.gate_up_proj{s}" in w for s in ("", ".weight")):
            _split_fused(w, p)
            continue
        for name in ("gate_proj", "up_proj", "down_proj"):
            stack_per_expert(w, f"{p}.experts.{{e}}.{name}", f"{p}.switch_mlp.{name}", num_experts)


def _split_fused(w: dict[str, mx.array], p: str) -> None:
    """Fused `[E, 2 * inter, in]` gate-and-up tensors (gate rows first), bare as transformers
    stores them or with their MLX-quantized parts; packing runs along `in`, so rows split the same."""
    for suffix in ("", *(f".{part}" for part in EXPERT_PARTS)):
        gate_up = w.pop(f"{p}.experts.gate_up_proj{suffix}", None)
        if gate_up is None:
            continue
        down = w.pop(f"{p}.experts.down_proj{suffix}", None)
        require(down is not None, f"checkpoint lacks {p}.experts.down_proj{suffix}")
        part = suffix or ".weight"
        mid = gate_up.shape[-2] // 2
        w[f"{p}.switch_mlp.gate_proj{part}"] = gate_up[..., :mid, :]
        w[f"{p}.switch_mlp.up_proj{part}"] = gate_up[..., mid:, :]
        w[f"{p}.switch_mlp.down_proj{part}"] = down


def sanitize_qwen(weights: dict[str, mx.array], args) -> dict[str, mx.array]:
    w = {_canonical(k): v for k, v in weights.items() if not k.startswith(_DROP_PREFIXES)}
    # Hugging Face stores conv weights as [C, 1, K]; MLX as [C, K, 1]. That also tells us whether
    # the norms still carry the zero-centred convention (MLX conversions have folded it in).
    from_hf = any(k.endswith("conv1d.weight") and v.shape[-1] != 1 for k, v in w.items())
    _stack_experts(w, args.num_experts)
    for k, v in list(w.items()):
        if k.endswith("conv1d.weight") and v.shape[-1] != 1:
            w[k] = v.moveaxis(2, 1)
        elif from_hf and v.ndim == 1 and _is_zero_centred(k):
            w[k] = v + 1.0
    if args.tie_word_embeddings:
        w.pop("lm_head.weight", None)
    if not args.wrapped:
        return w
    return {k if k.startswith("mtp.") else f"language_model.{k}": v for k, v in w.items()}
