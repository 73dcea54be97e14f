"""Qwen3.5 / Qwen3-Next hyperparameters from a Hugging Face config.json (text, MoE, vision-language)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kapitsa.engine.models.base import (
    known_fields,
    require,
)
from kapitsa.engine.ops.rope import complete_yarn

WRAPPED_TYPES = ("qwen3_5", "qwen3_5_moe")  # published as vision-language checkpoints


@dataclass
class ModelArgs:
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    intermediate_size: int = 0
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    linear_num_value_heads: int = 32
    linear_num_key_heads: int = 16
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    full_attention_interval: int = 4
    layer_types: list[str] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    attn_output_gate: bool = True
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    rope_scaling: dict[str, Any] | None = None
    rope_parameters: dict[str, Any] | None = None
    mtp_num_hidden_layers: int = 0
    mrope_section: list[int] | None = None  # rope frequencies per (time, height, width) axis, images
    max_position_embeddings: int = 32768  # transformers' default; YaRN's pre-training window when unset

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ModelArgs:
        text = dict(config.get("text_config") or config)
        text["model_type"] = config.get("model_type", text.get("model_type", "qwen3_5"))
        if "tie_word_embeddings" not in text and "tie_word_embeddings" in config:
            text["tie_word_embeddings"] = config["tie_word_embeddings"]
        for key in ("mlp_only_layers",):
            text[key] = text.get(key) or []
        return cls(**known_fields(cls, text))

    def __post_init__(self) -> None:
        rope = self.rope_parameters or {}
        self.rope_theta = float(rope.get("rope_theta", self.rope_theta))
        self.partial_rotary_factor = float(rope.get("partial_rotary_factor", self.partial_rotary_factor))
        if self.mrope_section is None and isinstance(rope.get("mrope_section"), list):
            self.mrope_section = [int(n) for n in rope["mrope_section"]]
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            self.rope_scaling = rope
        self.rope_scaling = complete_yarn(self.rope_scaling, self.max_position_embeddings)
        if self.layer_types is None:
            every = self.full_attention_interval
            self.layer_types = [
                "full_attention" if (i + 1) % every == 0 else "linear_attention"
                for i in range(self.num_hidden_layers)
            ]
        require(
            len(self.layer_types) == self.num_hidden_layers, "layer_types does not match num_hidden_layers"
        )
        unknown = set(self.layer_types) - {"full_attention", "linear_attention"}
        require(not unknown, f"unknown Qwen layer types {sorted(unknown)}")
        require(
            self.linear_num_value_heads % self.linear_num_key_heads == 0,
            "linear_num_value_heads must be a multiple of linear_num_key_heads",
        )

    @property
    def wrapped(self) -> bool:
        return self.model_type in WRAPPED_TYPES

    def is_moe_layer(self, i: int) -> bool:
        return (
            self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0
        )
