"""A Hugging Face config.json rebuilt from GGUF metadata and tensor shapes.

Layer kinds come from which tensors each block has (robust to metadata drift); sizes come from
the `{arch}.*` keys llama.cpp writes, cross-checked with tensor shapes where those decide.
"""

from __future__ import annotations

from typing import Any

from gguf import GGUFReader

from kapitsa.errors import CheckpointError, UnsupportedModel

Shapes = dict[str, tuple[int, ...]]  # GGUF tensor name -> numpy-order shape


def metadata_of(reader: GGUFReader) -> dict[str, Any]:
    """Every key-value field of the file, as plain Python values (token lists excluded)."""
    meta: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
            meta[name] = field  # large arrays: decoded lazily by the tokenizer builder
            continue
        try:
            meta[name] = field.contents()
        except (ValueError, IndexError, UnicodeDecodeError):
            continue
    return meta


def _get(meta: dict[str, Any], arch: str, key: str, default: Any = None, *, required: bool = False) -> Any:
    value = meta.get(f"{arch}.{key}", default)
    if value is None and required:
        raise CheckpointError(f"the GGUF file lacks the metadata key {arch}.{key}")
    return value


def _scalar(value: Any) -> Any:
    """Per-layer arrays (head_count_kv, feed_forward_length) -> their largest value."""
    return max(value) if isinstance(value, list) else value


def _block_tensors(shapes: Shapes, index: int) -> set[str]:
    prefix = f"blk.{index}."
    return {name[len(prefix) :] for name in shapes if name.startswith(prefix)}


def _block_count(meta: dict[str, Any], arch: str) -> int:
    blocks = int(_get(meta, arch, "block_count", required=True))
    return blocks - int(_get(meta, arch, "nextn_predict_layers", 0) or 0)  # MTP blocks come last


def config_from_gguf(arch: str, meta: dict[str, Any], shapes: Shapes) -> dict[str, Any]:
    if arch.startswith("qwen"):
        return _qwen_config(arch, meta, shapes)
    return _nemotron_config(arch, meta, shapes)


def _common(arch: str, meta: dict[str, Any], shapes: Shapes) -> dict[str, Any]:
    vocab, hidden = shapes["token_embd.weight"]
    return {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "max_position_embeddings": int(_get(meta, arch, "context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in shapes,
        "num_attention_heads": int(_scalar(_get(meta, arch, "attention.head_count", required=True))),
        "num_key_value_heads": int(_scalar(_get(meta, arch, "attention.head_count_kv", required=True))),
        "head_dim": int(_get(meta, arch, "attention.key_length", required=True)),
    }


def _qwen_config(arch: str, meta: dict[str, Any], shapes: Shapes) -> dict[str, Any]:
    n_layers = _block_count(meta, arch)
    config = _common(arch, meta, shapes)
    head_dim = config["head_dim"]
    rope_dims = int(_get(meta, arch, "rope.dimension_count", head_dim // 4))
    rope_theta = float(_get(meta, arch, "rope.freq_base", 10000000.0))
    value_heads = int(_get(meta, arch, "ssm.time_step_rank", required=True))
    layer_types = [
        "full_attention" if "attn_q.weight" in _block_tensors(shapes, i) else "linear_attention"
        for i in range(n_layers)
    ]
    config.update(
        model_type={"qwen35": "qwen3_5_text", "qwen35moe": "qwen3_5_moe_text"}.get(arch, "qwen3_next"),
        num_hidden_layers=n_layers,
        mtp_num_hidden_layers=int(_get(meta, arch, "nextn_predict_layers", 0) or 0),
        layer_types=layer_types,
        full_attention_interval=int(_get(meta, arch, "full_attention_interval", 4)),
        intermediate_size=int(_scalar(_get(meta, arch, "feed_forward_length", 0)) or 0),
        rms_norm_eps=float(_get(meta, arch, "attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=rope_theta,
        partial_rotary_factor=rope_dims / head_dim,
        attn_output_gate=True,
        linear_conv_kernel_dim=int(_get(meta, arch, "ssm.conv_kernel", required=True)),
        linear_key_head_dim=int(_get(meta, arch, "ssm.state_size", required=True)),
        linear_num_key_heads=int(_get(meta, arch, "ssm.group_count", required=True)),
        linear_num_value_heads=value_heads,
        linear_value_head_dim=int(_get(meta, arch, "ssm.inner_size", required=True)) // value_heads,
    )
    rope: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": rope_theta,
        "partial_rotary_factor": rope_dims / head_dim,
    }
    if (sections := _get(meta, arch, "rope.dimension_sections")) is not None:
        rope.update(mrope_section=[int(s) for s in sections[:3]], mrope_interleaved=True)
    config["rope_parameters"] = rope | _rope_scaling(meta, arch)
    if "blk.0.ffn_gate_inp.weight" in shapes or int(_get(meta, arch, "expert_count", 0) or 0) > 0:
        config.update(
            num_experts=int(_get(meta, arch, "expert_count", required=True)),
            num_experts_per_tok=int(_get(meta, arch, "expert_used_count", required=True)),
            moe_intermediate_size=int(_get(meta, arch, "expert_feed_forward_length", required=True)),
            shared_expert_intermediate_size=int(
                _get(meta, arch, "expert_shared_feed_forward_length", 0) or 0
            ),
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    return config


# `rope.scaling.yarn_*` keys convert_hf_to_gguf.py writes from a YaRN block's fields
_YARN_KEYS = {
    "yarn_attn_factor": "attention_factor",
    "yarn_beta_fast": "beta_fast",
    "yarn_beta_slow": "beta_slow",
}


def _rope_scaling(meta: dict[str, Any], arch: str) -> dict[str, Any]:
    """The rope block's scaling fields from the `rope.scaling.*` keys (a Qwen checkpoint converted
    with YaRN enabled keeps it there); {} for plain rope."""
    kind = _get(meta, arch, "rope.scaling.type")
    if kind in (None, "none"):
        return {}
    factor = float(_get(meta, arch, "rope.scaling.factor", required=True))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind != "yarn":
        raise UnsupportedModel(f"GGUF rope scaling {kind!r} is not supported (linear and yarn are)")
    scaling = {"rope_type": "yarn", "factor": factor}
    if (original := _get(meta, arch, "rope.scaling.original_context_length")) is not None:
        scaling["original_max_position_embeddings"] = int(original)
    for key, field in _YARN_KEYS.items():
        if (value := _get(meta, arch, f"rope.scaling.{key}")) is not None:
            scaling[field] = float(value)
    return scaling


def _nemotron_layer_symbol(tensors: set[str]) -> str:
    if "ssm_in.weight" in tensors:
        return "M"
    if "attn_q.weight" in tensors:
        return "*"
    if "ffn_up_exps.weight" in tensors:
        return "E"
    if "ffn_up.weight" in tensors:
        return "-"
    raise CheckpointError(f"cannot tell the kind of a Nemotron-H block with tensors {sorted(tensors)}")


def _nemotron_config(arch: str, meta: dict[str, Any], shapes: Shapes) -> dict[str, Any]:
    n_layers = _block_count(meta, arch)
    pattern = "".join(_nemotron_layer_symbol(_block_tensors(shapes, i)) for i in range(n_layers))
    config = _common(arch, meta, shapes)
    mamba = next(i for i, s in enumerate(pattern) if s == "M") if "M" in pattern else None
    config.update(
        model_type="nemotron_h",
        architectures=["NemotronHForCausalLM"],
        hybrid_override_pattern=pattern,
        num_hidden_layers=n_layers,
        layer_norm_epsilon=float(_get(meta, arch, "attention.layer_norm_rms_epsilon", 1e-5)),
        mlp_hidden_act="relu2",
    )
    dense = [i for i, s in enumerate(pattern) if s == "-"]
    if dense:
        config["intermediate_size"] = shapes[f"blk.{dense[0]}.ffn_up.weight"][0]
    if mamba is not None:
        config.update(_mamba_sizes(shapes, mamba, meta, arch))
    if "E" in pattern:
        config.update(_nemotron_moe_sizes(meta, arch, shapes, pattern.index("E")))
    return config


def _mamba_sizes(shapes: Shapes, index: int, meta: dict[str, Any], arch: str) -> dict[str, Any]:
    heads = shapes[f"blk.{index}.ssm_d"][0]
    groups, per_group = shapes[f"blk.{index}.ssm_norm.weight"]
    conv_dim, kernel = shapes[f"blk.{index}.ssm_conv1d.weight"]
    inner = groups * per_group
    return {
        "mamba_num_heads": heads,
        "mamba_head_dim": inner // heads,
        "n_groups": groups,
        "ssm_state_size": (conv_dim - inner) // (2 * groups),
        "conv_kernel": kernel,
        "use_conv_bias": f"blk.{index}.ssm_conv1d.bias" in shapes,
        "mamba_proj_bias": False,
        "chunk_size": 128,
    }


def _nemotron_moe_sizes(meta: dict[str, Any], arch: str, shapes: Shapes, index: int) -> dict[str, Any]:
    experts, inner, latent = shapes[f"blk.{index}.ffn_up_exps.weight"]
    sizes = {
        "n_routed_experts": experts,
        "moe_intermediate_size": inner,
        "num_experts_per_tok": int(_get(meta, arch, "expert_used_count", required=True)),
        "moe_shared_expert_intermediate_size": shapes[f"blk.{index}.ffn_up_shexp.weight"][0],
        "n_shared_experts": int(_get(meta, arch, "expert_shared_count", 1) or 1),
        "norm_topk_prob": bool(_get(meta, arch, "expert_weights_norm", True)),
        "routed_scaling_factor": float(_get(meta, arch, "expert_weights_scale", 1.0)),
        "n_group": int(_get(meta, arch, "expert_group_count", 1) or 1),
        "topk_group": int(_get(meta, arch, "expert_group_used_count", 1) or 1),
    }
    if f"blk.{index}.ffn_latent_down.weight" in shapes:
        sizes["moe_latent_size"] = latent
    return sizes
