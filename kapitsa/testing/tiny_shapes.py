"""Checkpoint tensor names and shapes for a config, in each family's published naming.

Each `*_shapes(config, ...)` returns {Hugging Face tensor name: shape}. tests/loading/test_tiny.py
compares them with what transformers' `save_pretrained` writes for the same config.
"""

from __future__ import annotations

from typing import Any

Shapes = dict[str, tuple[int, ...]]


def _linear(shapes: Shapes, name: str, out_features: int, in_features: int, *, bias: bool = False) -> None:
    shapes[f"{name}.weight"] = (out_features, in_features)
    if bias:
        shapes[f"{name}.bias"] = (out_features,)


def _gated_mlp(shapes: Shapes, prefix: str, hidden: int, inner: int) -> None:
    _linear(shapes, f"{prefix}.gate_proj", inner, hidden)
    _linear(shapes, f"{prefix}.up_proj", inner, hidden)
    _linear(shapes, f"{prefix}.down_proj", hidden, inner)


def _qwen_attention(shapes: Shapes, prefix: str, t: dict[str, Any]) -> None:
    hidden, head_dim = t["hidden_size"], t["head_dim"]
    q_heads, kv_heads = t["num_attention_heads"], t["num_key_value_heads"]
    gate = 2 if t.get("attn_output_gate", True) else 1
    _linear(shapes, f"{prefix}.q_proj", q_heads * head_dim * gate, hidden)
    _linear(shapes, f"{prefix}.k_proj", kv_heads * head_dim, hidden)
    _linear(shapes, f"{prefix}.v_proj", kv_heads * head_dim, hidden)
    _linear(shapes, f"{prefix}.o_proj", hidden, q_heads * head_dim)
    shapes[f"{prefix}.q_norm.weight"] = (head_dim,)
    shapes[f"{prefix}.k_norm.weight"] = (head_dim,)


def _gated_delta_net(shapes: Shapes, prefix: str, t: dict[str, Any], *, fused_projections: bool) -> None:
    hidden = t["hidden_size"]
    key_dim = t["linear_num_key_heads"] * t["linear_key_head_dim"]
    value_heads = t["linear_num_value_heads"]
    value_dim = value_heads * t["linear_value_head_dim"]
    conv_dim = 2 * key_dim + value_dim
    if fused_projections:  # Qwen3-Next
        _linear(shapes, f"{prefix}.in_proj_qkvz", 2 * key_dim + 2 * value_dim, hidden)
        _linear(shapes, f"{prefix}.in_proj_ba", 2 * value_heads, hidden)
    else:  # Qwen3.5
        _linear(shapes, f"{prefix}.in_proj_qkv", conv_dim, hidden)
        _linear(shapes, f"{prefix}.in_proj_z", value_dim, hidden)
        _linear(shapes, f"{prefix}.in_proj_b", value_heads, hidden)
        _linear(shapes, f"{prefix}.in_proj_a", value_heads, hidden)
    shapes[f"{prefix}.conv1d.weight"] = (conv_dim, 1, t["linear_conv_kernel_dim"])
    shapes[f"{prefix}.dt_bias"] = (value_heads,)
    shapes[f"{prefix}.A_log"] = (value_heads,)
    shapes[f"{prefix}.norm.weight"] = (t["linear_value_head_dim"],)
    _linear(shapes, f"{prefix}.out_proj", hidden, value_dim)


def _qwen_moe(shapes: Shapes, prefix: str, t: dict[str, Any], *, fused_experts: bool) -> None:
    hidden, experts, inner = t["hidden_size"], t["num_experts"], t["moe_intermediate_size"]
    _linear(shapes, f"{prefix}.gate", experts, hidden)
    if fused_experts:
        shapes[f"{prefix}.experts.gate_up_proj"] = (experts, 2 * inner, hidden)
        shapes[f"{prefix}.experts.down_proj"] = (experts, hidden, inner)
    else:
        for e in range(experts):
            _gated_mlp(shapes, f"{prefix}.experts.{e}", hidden, inner)
    _gated_mlp(shapes, f"{prefix}.shared_expert", hidden, t["shared_expert_intermediate_size"])
    _linear(shapes, f"{prefix}.shared_expert_gate", 1, hidden)


def _is_qwen_moe_layer(t: dict[str, Any], index: int) -> bool:
    if t.get("num_experts", 0) <= 0 or index in t.get("mlp_only_layers", []):
        return False
    return (index + 1) % t.get("decoder_sparse_step", 1) == 0


def _qwen_decoder_layer(
    shapes: Shapes,
    prefix: str,
    t: dict[str, Any],
    layer_type: str,
    is_moe: bool,
    *,
    next_style: bool,
    fused_experts: bool,
) -> None:
    hidden = t["hidden_size"]
    shapes[f"{prefix}.input_layernorm.weight"] = (hidden,)
    shapes[f"{prefix}.post_attention_layernorm.weight"] = (hidden,)
    if layer_type == "full_attention":
        _qwen_attention(shapes, f"{prefix}.self_attn", t)
    else:
        _gated_delta_net(shapes, f"{prefix}.linear_attn", t, fused_projections=next_style)
    if is_moe:
        _qwen_moe(shapes, f"{prefix}.mlp", t, fused_experts=fused_experts)
    else:
        _gated_mlp(shapes, f"{prefix}.mlp", hidden, t["intermediate_size"])


def _qwen_mtp(shapes: Shapes, t: dict[str, Any], *, next_style: bool) -> None:
    hidden = t["hidden_size"]
    _linear(shapes, "mtp.fc", hidden, 2 * hidden)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        shapes[f"mtp.{norm}.weight"] = (hidden,)
    is_moe = t.get("num_experts", 0) > 0
    for j in range(t.get("mtp_num_hidden_layers", 1)):
        # Qwen publishes the MTP block's experts per-expert even where the main layers are fused.
        _qwen_decoder_layer(
            shapes, f"mtp.layers.{j}", t, "full_attention", is_moe, next_style=next_style, fused_experts=False
        )


def _qwen_vision(shapes: Shapes, v: dict[str, Any]) -> None:
    h, merged = v["hidden_size"], v["hidden_size"] * v["spatial_merge_size"] ** 2
    p = v["patch_size"]
    shapes["model.visual.patch_embed.proj.weight"] = (h, v["in_channels"], v["temporal_patch_size"], p, p)
    shapes["model.visual.patch_embed.proj.bias"] = (h,)
    shapes["model.visual.pos_embed.weight"] = (v["num_position_embeddings"], h)
    for k in range(v["depth"]):
        block = f"model.visual.blocks.{k}"
        for norm in ("norm1", "norm2"):
            shapes[f"{block}.{norm}.weight"] = shapes[f"{block}.{norm}.bias"] = (h,)
        _linear(shapes, f"{block}.attn.qkv", 3 * h, h, bias=True)
        _linear(shapes, f"{block}.attn.proj", h, h, bias=True)
        _linear(shapes, f"{block}.mlp.linear_fc1", v["intermediate_size"], h, bias=True)
        _linear(shapes, f"{block}.mlp.linear_fc2", h, v["intermediate_size"], bias=True)
    shapes["model.visual.merger.norm.weight"] = shapes["model.visual.merger.norm.bias"] = (h,)
    _linear(shapes, "model.visual.merger.linear_fc1", merged, merged, bias=True)
    _linear(shapes, "model.visual.merger.linear_fc2", v["out_hidden_size"], merged, bias=True)


def qwen_shapes(config: dict[str, Any], *, mtp: bool, vision: bool, fused_experts: bool) -> Shapes:
    """Qwen3.5 (nested `text_config`, `model.language_model.*`) or Qwen3-Next (flat, `model.*`)."""
    next_style = "text_config" not in config
    t = config if next_style else config["text_config"]
    base = "model" if next_style else "model.language_model"
    fused_experts = fused_experts and not next_style  # Qwen3-Next is published per-expert
    layer_types = t.get("layer_types") or [
        "linear_attention" if (i + 1) % t.get("full_attention_interval", 4) else "full_attention"
        for i in range(t["num_hidden_layers"])
    ]
    shapes: Shapes = {f"{base}.embed_tokens.weight": (t["vocab_size"], t["hidden_size"])}
    for i, layer_type in enumerate(layer_types):
        is_moe = _is_qwen_moe_layer(t, i)
        _qwen_decoder_layer(
            shapes,
            f"{base}.layers.{i}",
            t,
            layer_type,
            is_moe,
            next_style=next_style,
            fused_experts=fused_experts,
        )
    shapes[f"{base}.norm.weight"] = (t["hidden_size"],)
    if not t.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (t["vocab_size"], t["hidden_size"])
    if mtp:
        _qwen_mtp(shapes, t, next_style=next_style)
    if vision and not next_style:
        _qwen_vision(shapes, config["vision_config"])
    return shapes


def _mamba2(shapes: Shapes, prefix: str, c: dict[str, Any]) -> None:
    hidden, heads = c["hidden_size"], c["mamba_num_heads"]
    inner = heads * c["mamba_head_dim"]
    conv_dim = inner + 2 * c["n_groups"] * c["ssm_state_size"]
    _linear(
        shapes, f"{prefix}.in_proj", inner + conv_dim + heads, hidden, bias=c.get("mamba_proj_bias", False)
    )
    shapes[f"{prefix}.conv1d.weight"] = (conv_dim, 1, c["conv_kernel"])
    if c.get("use_conv_bias", True):
        shapes[f"{prefix}.conv1d.bias"] = (conv_dim,)
    for name in ("dt_bias", "A_log", "D"):
        shapes[f"{prefix}.{name}"] = (heads,)
    shapes[f"{prefix}.norm.weight"] = (inner,)
    _linear(shapes, f"{prefix}.out_proj", hidden, inner, bias=c.get("mamba_proj_bias", False))


def _nemotron_moe(shapes: Shapes, prefix: str, c: dict[str, Any]) -> None:
    hidden, experts = c["hidden_size"], c["n_routed_experts"]
    latent = c.get("moe_latent_size") or hidden
    _linear(shapes, f"{prefix}.gate", experts, hidden)
    shapes[f"{prefix}.gate.e_score_correction_bias"] = (experts,)
    for e in range(experts):
        _linear(shapes, f"{prefix}.experts.{e}.up_proj", c["moe_intermediate_size"], latent)
        _linear(shapes, f"{prefix}.experts.{e}.down_proj", latent, c["moe_intermediate_size"])
    shared = c["moe_shared_expert_intermediate_size"]
    _linear(shapes, f"{prefix}.shared_experts.up_proj", shared, hidden)
    _linear(shapes, f"{prefix}.shared_experts.down_proj", hidden, shared)
    if c.get("moe_latent_size"):
        _linear(shapes, f"{prefix}.fc1_latent_proj", latent, hidden)
        _linear(shapes, f"{prefix}.fc2_latent_proj", hidden, latent)


_BLOCK_TYPE_SYMBOLS = {
    "mamba": "M",
    "linear_attention": "M",
    "attention": "*",
    "full_attention": "*",
    "mlp": "-",
    "moe": "E",
}


def nemotron_pattern(config: dict[str, Any]) -> str:
    """`hybrid_override_pattern`, or the same spelled as the newer `layers_block_type` list."""
    if "layers_block_type" in config:
        return "".join(_BLOCK_TYPE_SYMBOLS[t] for t in config["layers_block_type"])
    return config["hybrid_override_pattern"]


def nemotron_shapes(config: dict[str, Any]) -> Shapes:
    c, hidden = config, config["hidden_size"]
    shapes: Shapes = {"backbone.embeddings.weight": (c["vocab_size"], hidden)}
    for i, symbol in enumerate(nemotron_pattern(c)):
        prefix = f"backbone.layers.{i}"
        shapes[f"{prefix}.norm.weight"] = (hidden,)
        if symbol == "M":
            _mamba2(shapes, f"{prefix}.mixer", c)
        elif symbol == "*":
            q_dim, kv_dim = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
            _linear(shapes, f"{prefix}.mixer.q_proj", q_dim, hidden)
            _linear(shapes, f"{prefix}.mixer.k_proj", kv_dim, hidden)
            _linear(shapes, f"{prefix}.mixer.v_proj", kv_dim, hidden)
            _linear(shapes, f"{prefix}.mixer.o_proj", hidden, q_dim)
        elif symbol == "-":
            _linear(shapes, f"{prefix}.mixer.up_proj", c["intermediate_size"], hidden)
            _linear(shapes, f"{prefix}.mixer.down_proj", hidden, c["intermediate_size"])
        elif symbol == "E":
            _nemotron_moe(shapes, f"{prefix}.mixer", c)
        else:
            raise ValueError(f"unknown hybrid_override_pattern symbol {symbol!r}")
    shapes["backbone.norm_f.weight"] = (hidden,)
    if not c.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (c["vocab_size"], hidden)
    return shapes
