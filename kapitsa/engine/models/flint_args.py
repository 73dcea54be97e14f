"""Flint hyperparameters from a Hugging Face config.json (the keys mlx-vlm 0.7.10's flint/config.py reads)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kapitsa.engine.models.base import known_fields, require

LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass
class ModelArgs:
    model_type: str = "flint"
    hidden_size: int = 2048
    intermediate_size: int = 6144
    num_hidden_layers: int = 49
    num_attention_heads: int = 32
    num_key_value_heads: int = 4
    head_dim: int = 128
    vocab_size: int = 150144
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 262144
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rope_parameters: dict[str, Any] | None = None
    layer_types: list[str] | None = None
    no_rope_layer_indices: list[int] = field(default_factory=list)
    use_sliding_window: bool = True
    sliding_window: int | None = 513
    softmax_type: str = "learnable"
    attention_bias: bool = False
    hidden_act: str = "silu"
    mlp_only_layers: list[int] = field(default_factory=list)
    num_experts: int = 256
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 1024
    router_score_function: str = "sigmoid"
    norm_topk_prob: bool = True
    tie_word_embeddings: bool = False

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ModelArgs:
        text = dict(config.get("text_config") or config)
        text["model_type"] = config.get("model_type", text.get("model_type", "flint"))
        for key in ("mlp_only_layers", "no_rope_layer_indices"):
            text[key] = text.get(key) or []
        return cls(**known_fields(cls, text))

    def __post_init__(self) -> None:
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        require(
            len(self.layer_types) == self.num_hidden_layers, "layer_types does not match num_hidden_layers"
        )
        unknown = set(self.layer_types) - set(LAYER_TYPES)
        require(not unknown, f"unknown Flint layer types {sorted(unknown)}")
        if not self.use_sliding_window:
            self.sliding_window = None
        require(self.sliding_window is None or self.sliding_window >= 1, "sliding_window must be positive")
        require(
            self.hidden_act == "silu" and self.router_score_function == "sigmoid",
            "Flint has SiLU experts and sigmoid routing",
        )
        require(
            self.softmax_type == "learnable", "Flint has learned attention sinks (softmax_type 'learnable')"
        )
        require(1 <= self.num_experts_per_tok <= self.num_experts, "num_experts_per_tok out of range")
        if self.rope_parameters is not None:
            self.rope_theta = float(self.rope_parameters.get("rope_theta", self.rope_theta))
            self.rope_scaling = self.rope_parameters

    def window(self, i: int) -> int | None:
        """Layer i's sliding window (positions a query sees, itself included), None for full attention."""
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None

    def uses_rope(self, i: int) -> bool:
        return i not in self.no_rope_layer_indices

    def is_moe_layer(self, i: int) -> bool:
        return i not in self.mlp_only_layers
