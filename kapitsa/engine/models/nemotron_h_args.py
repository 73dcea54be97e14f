"""Nemotron-H hyperparameters as read from a Hugging Face config.json, with its layer pattern."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kapitsa.engine.models.base import (
    known_fields,
    require,
)
from kapitsa.engine.models.nemotron_mtp import mtp_pattern

_BLOCK_CHARS = {
    "linear_attention": "M",
    "mamba": "M",
    "full_attention": "*",
    "attention": "*",
    "moe": "E",
    "mlp": "-",
}


@dataclass
class ModelArgs:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    pattern: str
    mtp_pattern: str = ""  # the block kinds of one MTP step ("*E"); "" when the config names none
    head_dim: int | None = None
    attention_bias: bool = False
    intermediate_size: int = 0
    mlp_bias: bool = False
    mamba_num_heads: int = 128
    mamba_head_dim: int = 64
    ssm_state_size: int = 128
    n_groups: int = 8
    conv_kernel: int = 4
    use_conv_bias: bool = True
    use_bias: bool = False
    layer_norm_epsilon: float = 1e-5
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_shared_expert_intermediate_size: int = 0
    n_shared_experts: int | None = 1  # transformers' default: every MoE block has its shared expert
    moe_latent_size: int | None = None
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ModelArgs:
        params = dict(config)
        params["pattern"] = _pattern(config)
        params["mtp_pattern"] = mtp_pattern(config)
        # transformers' NemotronHConfig defaults an absent head_dim to 128, not hidden / heads
        # (a Nano-class 2688 / 32 would be 84); a null one still falls back to hidden / heads.
        params.setdefault("head_dim", 128)
        # Older configs spell some Mamba fields with a `mamba_` prefix.
        for old, new in (
            ("mamba_n_groups", "n_groups"),
            ("mamba_d_conv", "conv_kernel"),
            ("mamba_conv_bias", "use_conv_bias"),
            ("mamba_dt_limit", "time_step_limit"),
        ):
            if old in params and new not in params:
                params[new] = params[old]
        return cls(**known_fields(cls, params))

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        # configs spell "not used" as null; fall back to the neutral values
        self.n_group, self.topk_group = self.n_group or 1, self.topk_group or 1
        self.routed_scaling_factor = float(self.routed_scaling_factor or 1.0)
        self.norm_topk_prob = True if self.norm_topk_prob is None else self.norm_topk_prob
        self.n_routed_experts, self.num_experts_per_tok = (
            self.n_routed_experts or 0,
            self.num_experts_per_tok or 0,
        )
        lo, hi = self.time_step_limit if self.time_step_limit is not None else (0.0, float("inf"))
        self.time_step_limit = (float(lo), float(hi))
        require(self.mamba_num_heads % self.n_groups == 0, "mamba_num_heads must be a multiple of n_groups")
        if "E" in self.pattern:
            require(
                self.n_routed_experts > 0 and self.num_experts_per_tok > 0, "MoE layers need n_routed_experts"
            )
            require(
                self.n_routed_experts % self.n_group == 0, "n_routed_experts must be a multiple of n_group"
            )


def _pattern(config: dict[str, Any]) -> str:
    pattern = config.get("hybrid_override_pattern")
    if pattern is None:
        blocks = config.get("layers_block_type") or config.get("layer_types")
        require(blocks is not None, "config has neither hybrid_override_pattern nor layers_block_type")
        unknown = sorted(set(blocks) - _BLOCK_CHARS.keys())
        require(not unknown, f"unknown Nemotron-H block types {unknown}")
        pattern = "".join(_BLOCK_CHARS[b] for b in blocks)
    pattern = "".join(pattern)
    require(bool(pattern) and set(pattern) <= set("M*-E"), f"bad hybrid_override_pattern {pattern!r}")
    return pattern
