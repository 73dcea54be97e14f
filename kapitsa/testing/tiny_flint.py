"""A tiny random Flint checkpoint, written under the names mlx-vlm 0.7.10's flint/ reads.

Hidden size 64, 4 layers covering every layer kind: sliding-window attention with RoPE (a window
of 16, so short prompts already cross it), full attention without RoPE, a dense MLP layer, and
MoE layers of 8 sigmoid-routed experts (top 2) plus a shared expert. The tokenizer and chat
template are the tiny Qwen ones (ChatML), the vocabulary padded to `TINY_VOCAB_SIZE` rows.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any, Literal

import numpy as np

from kapitsa.engine.loading.safetensors_io import BF16, float32_to_bfloat16_bits, write_sharded_safetensors
from kapitsa.testing.tiny import TINY_VOCAB_SIZE
from kapitsa.testing.tiny_tokenizer import (
    QWEN_TEMPLATE,
    dumps,
    generation_config,
    token_ids,
    tokenizer_config,
    tokenizer_json,
)

TINY_WINDOW = 16

_FLINT: dict[str, Any] = {
    "architectures": ["FlintForCausalLM"],
    "model_type": "flint",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
    "no_rope_layer_indices": [1],
    "use_sliding_window": True,
    "sliding_window": TINY_WINDOW,
    "softmax_type": "learnable",
    "attention_bias": False,
    "hidden_act": "silu",
    "mlp_only_layers": [2],
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
    "router_score_function": "sigmoid",
    "norm_topk_prob": True,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def flint_config(**overrides: Any) -> dict[str, Any]:
    """The config.json of the tiny Flint (overrides: any key, e.g. `sliding_window=8`)."""
    config = {**_FLINT, "vocab_size": TINY_VOCAB_SIZE, **overrides}
    ids = token_ids("qwen")
    config.setdefault("eos_token_id", ids["<|im_end|>"])
    config.setdefault("bos_token_id", ids["<|endoftext|>"])
    return config


def flint_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor names -> shapes (per-expert tensors, as mlx-vlm's sanitize stacks them)."""
    H, D, V = config["hidden_size"], config["head_dim"], config["vocab_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not config.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (V, H)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {f"{p}input_layernorm.weight": (H,), f"{p}post_attention_layernorm.weight": (H,)}
        a = f"{p}self_attn."
        shapes |= {
            f"{a}q_proj.weight": (heads * D, H), f"{a}k_proj.weight": (kv * D, H),
            f"{a}v_proj.weight": (kv * D, H), f"{a}o_proj.weight": (H, heads * D),
            f"{a}q_norm.weight": (D,), f"{a}k_norm.weight": (D,), f"{a}softmax_offset": (heads,),
        }  # fmt: skip
        if i in config.get("mlp_only_layers", []):
            _swiglu(shapes, f"{p}mlp.", H, config["intermediate_size"])
            continue
        E = config["num_experts"]
        shapes |= {f"{p}mlp.gate.weight": (E, H), f"{p}mlp.gate.e_score_correction_bias": (E,)}
        for e in range(E):
            _swiglu(shapes, f"{p}mlp.experts.{e}.", H, config["moe_intermediate_size"])
        if config["shared_expert_intermediate_size"] > 0:
            _swiglu(shapes, f"{p}mlp.shared_expert.", H, config["shared_expert_intermediate_size"])
    return shapes


def _swiglu(shapes: dict[str, tuple[int, ...]], prefix: str, hidden: int, inner: int) -> None:
    shapes |= {
        f"{prefix}gate_proj.weight": (inner, hidden),
        f"{prefix}up_proj.weight": (inner, hidden),
        f"{prefix}down_proj.weight": (hidden, inner),
    }


def _init(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Values on a trained model's scale; sinks and router biases large enough to matter."""
    if name.endswith("softmax_offset"):
        return rng.standard_normal(shape)
    if name.endswith("e_score_correction_bias"):
        return 0.1 * rng.standard_normal(shape)
    if len(shape) == 1:
        return 1.0 + 0.1 * rng.standard_normal(shape)
    if "embed" in name:
        return rng.standard_normal(shape)
    return rng.standard_normal(shape) / np.sqrt(shape[-1])


def flint_weights(config: dict[str, Any], *, seed: int = 0) -> dict[str, np.ndarray]:
    """float32 weights under their Hugging Face names; each depends only on (seed, name)."""
    out = {}
    for name, shape in flint_shapes(config).items():
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        out[name] = _init(name, shape, rng).astype(np.float32)
    return out


def write_tiny_flint(
    path: str | Path,
    *,
    seed: int = 0,
    dtype: Literal["float32", "bfloat16"] = "float32",
    **config_overrides: Any,
) -> Path:
    """Write the tiny Flint checkpoint folder (config, safetensors, tokenizer) and return its path."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    config = flint_config(torch_dtype=dtype, **config_overrides)
    weights = flint_weights(config, seed=seed)
    stored = {n: v if dtype == "float32" else BF16(float32_to_bfloat16_bits(v)) for n, v in weights.items()}
    write_sharded_safetensors(folder, stored, 1)
    (folder / "config.json").write_text(dumps(config))
    (folder / "generation_config.json").write_text(dumps(generation_config("qwen")))
    (folder / "tokenizer.json").write_text(tokenizer_json("qwen"))
    (folder / "tokenizer_config.json").write_text(dumps(tokenizer_config("qwen", template=QWEN_TEMPLATE)))
    return folder
