"""Tiny configs in the published config.json shape of each model family, and the tensor names and
shapes a Hugging Face checkpoint of that config holds (checked against transformers' own
`save_pretrained` output in tests/loading/test_tiny.py).

Shapes follow the published checkpoints:
- Qwen3.5 / 3.6 (`Qwen3_5ForConditionalGeneration`): `model.language_model.*`, `lm_head`, optional
  `model.visual.*` and `mtp.*`. MoE experts are stored fused (`mlp.experts.gate_up_proj`
  [E, 2I, H], `mlp.experts.down_proj` [E, H, I]) as Qwen publishes them; re-saved copies use
  per-expert `mlp.experts.{e}.gate_proj.weight`; the MTP block of Qwen3.5 MoE is per-expert.
- Qwen3-Next (`Qwen3NextForCausalLM`): `model.*`, fused `in_proj_qkvz` / `in_proj_ba`, per-expert.
- Nemotron-H (`NemotronHForCausalLM`): `backbone.*`, per-expert `mixer.experts.{e}.up_proj.weight`.
"""

from __future__ import annotations

import copy
from typing import Any

Shapes = dict[str, tuple[int, ...]]

KINDS = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "nemotron_h", "nemotron_h_dense")

_QWEN_TEXT: dict[str, Any] = {
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_output_gate": True,
    "dtype": "bfloat16",
    "full_attention_interval": 4,
    "head_dim": 32,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 128,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_value_head_dim": 16,
    "mamba_ssm_dtype": "float32",
    "max_position_embeddings": 262144,
    "mtp_num_hidden_layers": 1,
    "mtp_use_dedicated_embeddings": False,
    "num_attention_heads": 4,
    "num_hidden_layers": 4,
    "num_key_value_heads": 2,
    "pad_token_id": None,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {
        "mrope_interleaved": True,
        "mrope_section": [2, 1, 1],
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000000,
        "rope_type": "default",
    },
    "tie_word_embeddings": False,
    "use_cache": True,
}

_QWEN_MOE_EXTRA = {
    "moe_intermediate_size": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 48,
}

_QWEN_VISION = {
    "deepstack_visual_indexes": [],
    "depth": 1,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_size": 16,
    "in_channels": 3,
    "initializer_range": 0.02,
    "intermediate_size": 32,
    "num_heads": 2,
    "num_position_embeddings": 16,
    "patch_size": 4,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}

_QWEN_NEXT: dict[str, Any] = {
    "architectures": ["Qwen3NextForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "decoder_sparse_step": 1,
    "full_attention_interval": 4,
    "head_dim": 32,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 128,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_value_head_dim": 16,
    "max_position_embeddings": 262144,
    "mlp_only_layers": [],
    "model_type": "qwen3_next",
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
    "num_attention_heads": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 4,
    "num_key_value_heads": 2,
    "output_router_logits": False,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 10000000,
    "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 48,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
}

_NEMOTRON: dict[str, Any] = {
    "architectures": ["NemotronHForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "chunk_size": 128,
    "conv_kernel": 4,
    "expand": 2,
    "head_dim": 16,
    "hidden_dropout": 0.0,
    "hidden_size": 64,
    "hybrid_override_pattern": "MEM*",
    "initializer_range": 0.02,
    "intermediate_size": 96,
    "layer_norm_epsilon": 1e-05,
    "mamba_head_dim": 16,
    "mamba_hidden_act": "silu",
    "mamba_num_heads": 4,
    "mamba_proj_bias": False,
    "mamba_ssm_cache_dtype": "float32",
    "max_position_embeddings": 262144,
    "mlp_bias": False,
    "mlp_hidden_act": "relu2",
    "model_type": "nemotron_h",
    "moe_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 48,
    "n_group": 1,
    "n_groups": 2,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "norm_eps": 1e-05,
    "norm_topk_prob": True,
    "num_attention_heads": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 4,
    "num_key_value_heads": 2,
    "num_logits_to_keep": 1,
    "partial_rotary_factor": 1.0,
    "rescale_prenorm_residual": True,
    "residual_in_fp32": False,
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "sliding_window": None,
    "ssm_state_size": 16,
    "tie_word_embeddings": False,
    "time_step_floor": 0.0001,
    "time_step_max": 0.1,
    "time_step_min": 0.001,
    "topk_group": 1,
    "torch_dtype": "bfloat16",
    "use_bias": False,
    "use_cache": True,
    "use_conv_bias": True,
    "use_mamba_kernels": True,
}


def _qwen_layer_types(text: dict[str, Any]) -> list[str]:
    interval = text.get("full_attention_interval", 4)
    return [
        "linear_attention" if (i + 1) % interval else "full_attention"
        for i in range(text["num_hidden_layers"])
    ]


def make_config(
    kind: str, *, vocab_size: int, token_ids: dict[str, int], overrides: dict[str, Any]
) -> dict[str, Any]:
    """The config.json dict of a tiny `kind` model; `overrides` go to the text config."""
    if kind in ("qwen3_5", "qwen3_5_moe"):
        return _qwen3_5_config(kind, vocab_size, token_ids, overrides)
    if kind == "qwen3_next":
        config = {**copy.deepcopy(_QWEN_NEXT), "vocab_size": vocab_size, **overrides}
        config["bos_token_id"] = token_ids["<|endoftext|>"]
        config["eos_token_id"] = token_ids["<|im_end|>"]
        return dict(sorted(config.items()))
    if kind in ("nemotron_h", "nemotron_h_dense"):
        config = copy.deepcopy(_NEMOTRON)
        if kind == "nemotron_h_dense":
            config["hybrid_override_pattern"] = "M-*-"
        config.update(vocab_size=vocab_size, bos_token_id=token_ids["<s>"], eos_token_id=token_ids["</s>"])
        config["pad_token_id"] = token_ids["<unk>"]
        config.update(overrides)
        if "layers_block_type" in overrides:  # the newer spelling replaces the pattern string
            config.pop("hybrid_override_pattern")
            config["num_hidden_layers"] = len(config["layers_block_type"])
        else:
            config["num_hidden_layers"] = len(config["hybrid_override_pattern"])
        return dict(sorted(config.items()))
    raise ValueError(f"unknown tiny model kind {kind!r}; choose one of {', '.join(KINDS)}")


def _qwen3_5_config(
    kind: str, vocab_size: int, token_ids: dict[str, int], overrides: dict[str, Any]
) -> dict[str, Any]:
    is_moe = kind == "qwen3_5_moe"
    text = {**copy.deepcopy(_QWEN_TEXT), **(_QWEN_MOE_EXTRA if is_moe else {})}
    text.update(model_type=f"{kind}_text", vocab_size=vocab_size)
    text.update(bos_token_id=token_ids["<|endoftext|>"], eos_token_id=token_ids["<|endoftext|>"])
    text.update(overrides)
    if "layer_types" not in overrides:
        text["layer_types"] = _qwen_layer_types(text)
    vision = {**_QWEN_VISION, "model_type": kind, "out_hidden_size": text["hidden_size"]}
    return {
        "architectures": [
            "Qwen3_5MoeForConditionalGeneration" if is_moe else "Qwen3_5ForConditionalGeneration"
        ],
        "image_token_id": token_ids["<|image_pad|>"],
        "language_model_only": False,
        "model_type": kind,
        "text_config": dict(sorted(text.items())),
        "tie_word_embeddings": text["tie_word_embeddings"],
        "transformers_version": "4.57.1",
        "video_token_id": token_ids["<|video_pad|>"],
        "vision_config": vision,
        "vision_end_token_id": token_ids["<|vision_end|>"],
        "vision_start_token_id": token_ids["<|vision_start|>"],
    }
