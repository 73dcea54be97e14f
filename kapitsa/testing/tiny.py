"""Tiny random checkpoints written exactly as Hugging Face publishes each model family.

`write_tiny_checkpoint(path, kind)` makes a real checkpoint folder (config.json, safetensors,
tokenizer.json, tokenizer_config.json with a chat template, generation_config.json) for tests:
hidden size 64, 4 layers covering every layer kind, vocab under 1024, deterministic per seed.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any, Literal

import numpy as np

from kapitsa.engine.loading.safetensors_io import (
    BF16,
    Tensor,
    float32_to_bfloat16_bits,
    write_sharded_safetensors,
)
from kapitsa.testing.tiny_configs import KINDS, make_config
from kapitsa.testing.tiny_shapes import Shapes, nemotron_shapes, qwen_shapes
from kapitsa.testing.tiny_tokenizer import (
    chat_template_for,
    dumps,
    generation_config,
    token_ids,
    tokenizer_config,
    tokenizer_json,
)
from kapitsa.testing.tiny_vision import (
    NEMOTRON_VL_TYPE,
    nemotron_preprocessor_config,
    nemotron_vl_config,
    radio_shapes,
)

__all__ = [
    "KINDS",
    "TINY_VOCAB_SIZE",
    "tiny_config",
    "tiny_preprocessor_config",
    "tiny_weights",
    "write_tiny_checkpoint",
]

Kind = Literal["qwen3_5", "qwen3_5_moe", "qwen3_next", "nemotron_h", "nemotron_h_dense"]
TINY_VOCAB_SIZE = 512  # model rows; the tokenizer uses fewer (real checkpoints pad the same way)

# Norms that Qwen applies as (1 + weight), so weights sit around 0 (Qwen3-Next/3.5 RMSNorm)
_ZERO_CENTERED_NORMS = (
    "input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight",
    "model.norm.weight", "language_model.norm.weight", "mtp.norm.weight", "pre_fc_norm_embedding.weight",
    "pre_fc_norm_hidden.weight",
)  # fmt: skip


def _family(kind: str) -> str:
    return "nemotron" if kind.startswith("nemotron") else "qwen"


def tiny_config(kind: Kind, **config_overrides: Any) -> dict[str, Any]:
    """The config.json of a tiny `kind` model (overrides go to the text config)."""
    family = _family(kind)
    return make_config(
        kind, vocab_size=TINY_VOCAB_SIZE, token_ids=token_ids(family), overrides=config_overrides
    )


def tiny_shapes(
    config: dict[str, Any], *, mtp: bool = False, vision: bool = False, fused_experts: bool = True
) -> Shapes:
    if config["model_type"] == "nemotron_h":
        return nemotron_shapes(config)
    if config["model_type"] == NEMOTRON_VL_TYPE:
        text = {f"language_model.{k}": v for k, v in nemotron_shapes(config["text_config"]).items()}
        return text | radio_shapes(config)
    return qwen_shapes(config, mtp=mtp, vision=vision, fused_experts=fused_experts)


def _init_values(name: str, shape: tuple[int, ...], rng: np.random.Generator, qwen: bool) -> np.ndarray:
    """Random values on the scale a trained model has, so logits are well spread."""
    if name.endswith("A_log"):
        return np.log(rng.uniform(1.0, 16.0, shape))
    if name.endswith("dt_bias"):
        return np.log(np.expm1(rng.uniform(0.001, 0.1, shape)))  # inverse softplus of dt
    if name.endswith(".D"):
        return 1.0 + 0.1 * rng.standard_normal(shape)
    if name.endswith("e_score_correction_bias"):
        return 0.1 * rng.standard_normal(shape)
    if len(shape) == 1 and ("norm" in name):
        centered = qwen and name.endswith(_ZERO_CENTERED_NORMS)
        return (0.0 if centered else 1.0) + 0.1 * rng.standard_normal(shape)
    if name.endswith(".bias"):
        return 0.02 * rng.standard_normal(shape)
    if "embed" in name and len(shape) == 2:
        return rng.standard_normal(shape)
    fan_in = shape[-1] if len(shape) > 1 else 1
    if name.endswith("conv1d.weight") or "patch_embed" in name:
        fan_in = int(np.prod(shape[1:]))
    return rng.standard_normal(shape) / np.sqrt(fan_in)


def tiny_weights(
    config: dict[str, Any],
    *,
    seed: int = 0,
    mtp: bool = False,
    vision: bool = False,
    fused_experts: bool = True,
) -> dict[str, np.ndarray]:
    """float32 weights under their Hugging Face names; each tensor's values depend only on (seed, name)."""
    qwen = config["model_type"] not in ("nemotron_h", NEMOTRON_VL_TYPE)
    weights = {}
    for name, shape in tiny_shapes(config, mtp=mtp, vision=vision, fused_experts=fused_experts).items():
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        weights[name] = _init_values(name, shape, rng, qwen).astype(np.float32)
    return weights


def _stored(name: str, values: np.ndarray, dtype: str) -> Tensor:
    # Nemotron-H checkpoints keep the router in float32 even when the rest is bf16
    if dtype == "float32" or "mixer.gate." in name:
        return values
    if dtype == "float16":
        return values.astype(np.float16)
    return BF16(float32_to_bfloat16_bits(values))


def write_tiny_checkpoint(
    path: str | Path,
    kind: Kind,
    *,
    seed: int = 0,
    dtype: Literal["float32", "bfloat16", "float16"] = "float32",
    shards: int = 1,
    mtp: bool = False,
    vision: bool = False,
    fused_experts: bool = True,
    chat_template_file: bool = False,
    **config_overrides: Any,
) -> Path:
    """Write a tiny random Hugging Face checkpoint folder and return its path.

    Args:
        path: folder to create (may exist; files in it are overwritten).
        kind: "qwen3_5", "qwen3_5_moe", "qwen3_next", "nemotron_h" (Mamba-2 + MoE + attention)
            or "nemotron_h_dense" (Mamba-2 + MLP + attention).
        seed: weights depend only on (seed, tensor name).
        dtype: storage dtype of the safetensors.
        shards: >1 writes `model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json`.
        mtp: add the `mtp.*` multi-token-prediction block (Qwen kinds).
        vision: add the `model.visual.*` tower (Qwen3.5 kinds), as the published checkpoints have;
            for Nemotron-H kinds, write the vision-language omni layout (tiny_vision.py) instead.
        fused_experts: Qwen3.5 MoE experts as Qwen publishes them (`experts.gate_up_proj`), or
            per-expert tensors as re-saved copies have them.
        chat_template_file: put the template in `chat_template.jinja` instead of tokenizer_config.json.
        config_overrides: text-config keys to change, e.g. `hidden_size=32`, `tie_word_embeddings=True`,
            `layer_types=[...]`, `hybrid_override_pattern="M*-E"`.
    Returns:
        The folder path.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown tiny model kind {kind!r}; choose one of {', '.join(KINDS)}")
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    config = tiny_config(kind, **config_overrides)
    if vision and _family(kind) == "nemotron":
        config = nemotron_vl_config(config, token_ids("nemotron"))
    if "text_config" in config:
        config["text_config"]["dtype"] = dtype
    else:
        config["torch_dtype"] = dtype
    weights = tiny_weights(config, seed=seed, mtp=mtp, vision=vision, fused_experts=fused_experts)
    write_sharded_safetensors(folder, {n: _stored(n, v, dtype) for n, v in weights.items()}, shards)
    family = _family(kind)
    (folder / "config.json").write_text(dumps(config))
    (folder / "generation_config.json").write_text(dumps(generation_config(family)))
    (folder / "tokenizer.json").write_text(tokenizer_json(family))
    template = chat_template_for(kind)
    tok_config = tokenizer_config(family, template=None if chat_template_file else template)
    (folder / "tokenizer_config.json").write_text(dumps(tok_config))
    if chat_template_file:
        (folder / "chat_template.jinja").write_text(template)
    if vision and config["model_type"] == NEMOTRON_VL_TYPE:
        (folder / "preprocessor_config.json").write_text(dumps(nemotron_preprocessor_config(config)))
    elif vision and "vision_config" in config:
        (folder / "preprocessor_config.json").write_text(dumps(tiny_preprocessor_config(config)))
    return folder


def tiny_preprocessor_config(config: dict[str, Any]) -> dict[str, Any]:
    """preprocessor_config.json of a tiny Qwen3.5 vision checkpoint, in Qwen's published form, with a
    pixel budget of 16x16 to 64x64 (4 to 64 image tokens) so image prompts stay short."""
    v = config["vision_config"]
    return {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "image_std": [0.5, 0.5, 0.5],
        "merge_size": v["spatial_merge_size"],
        "patch_size": v["patch_size"],
        "processor_class": "Qwen3VLProcessor",
        "rescale_factor": 1 / 255,
        "size": {"longest_edge": 64 * 64, "shortest_edge": 16 * 16},
        "temporal_patch_size": v["temporal_patch_size"],
    }
