"""Tiny vision-language Nemotron-H checkpoints: the published omni layout (`text_config`, a RADIO
`vision_config`, `mlp1` projector, `language_model.*` text tensors) at test widths, and its
preprocessor_config.json (NVIDIA's keys) with a 16-to-64-patch budget."""

from __future__ import annotations

from typing import Any

from kapitsa.testing.tiny_shapes import Shapes

NEMOTRON_VL_TYPE = "nemotron_h_nano_omni"
_RADIO = {
    "args": {"cls_token_per_teacher": True, "cpe_max_size": 64, "register_multiple": 4, "teachers": []},
    "hidden_size": 32,
    "image_size": 16,
    "intermediate_size": 64,
    "max_resolution": 64,
    "model_type": "radio",
    "num_attention_heads": 2,
    "num_hidden_layers": 2,
    "patch_size": 4,
    "video_temporal_patch_size": 2,
}


def nemotron_vl_config(text: dict[str, Any], token_ids: dict[str, int]) -> dict[str, Any]:
    return {
        "architectures": ["NemotronH_Nano_Omni_Reasoning_V3"],
        "downsample_ratio": 0.5,
        "img_context_token_id": token_ids["<image>"],
        "model_type": NEMOTRON_VL_TYPE,
        "projector_hidden_size": 48,
        "ps_version": "v2",
        "text_config": text,
        "vision_config": dict(_RADIO),
        "vit_hidden_size": _RADIO["hidden_size"],
    }


def radio_shapes(config: dict[str, Any]) -> Shapes:
    """The tower and projector tensors as the published checkpoints name them."""
    v = config["vision_config"]
    d, p, inner = v["hidden_size"], v["patch_size"], v["intermediate_size"]
    side = v["args"]["cpe_max_size"] // p
    tower = "vision_model.radio_model"
    shapes: Shapes = {
        f"{tower}.input_conditioner.norm_mean": (3, 1, 1),
        f"{tower}.input_conditioner.norm_std": (3, 1, 1),
        f"{tower}.model.patch_generator.cls_token.token": (4, d),  # 1 class token + 3 registers
        f"{tower}.model.patch_generator.embedder.weight": (d, 3 * p * p),
        f"{tower}.model.patch_generator.video_embedder.weight": (d, 2 * 3 * p * p),
        f"{tower}.model.patch_generator.pos_embed": (1, side * side, d),
    }
    for i in range(v["num_hidden_layers"]):
        block = f"{tower}.model.blocks.{i}"
        for norm in ("norm1", "norm2"):
            shapes[f"{block}.{norm}.weight"] = shapes[f"{block}.{norm}.bias"] = (d,)
        shapes[f"{block}.attn.qkv.weight"], shapes[f"{block}.attn.qkv.bias"] = (3 * d, d), (3 * d,)
        shapes[f"{block}.attn.proj.weight"], shapes[f"{block}.attn.proj.bias"] = (d, d), (d,)
        shapes[f"{block}.mlp.fc1.weight"], shapes[f"{block}.mlp.fc1.bias"] = (inner, d), (inner,)
        shapes[f"{block}.mlp.fc2.weight"], shapes[f"{block}.mlp.fc2.bias"] = (d, inner), (d,)
    merged, hidden = 4 * config["vit_hidden_size"], config["projector_hidden_size"]
    shapes["mlp1.0.weight"] = (merged,)
    shapes["mlp1.1.weight"] = (hidden, merged)
    shapes["mlp1.3.weight"] = (config["text_config"]["hidden_size"], hidden)
    return shapes


def nemotron_preprocessor_config(config: dict[str, Any]) -> dict[str, Any]:
    return {
        "downsample_ratio": config["downsample_ratio"],
        "image_processor_type": "NemotronHNanoOmniImageProcessor",
        "max_model_len": 16384,
        "max_num_patches": 64,
        "min_num_patches": 16,
        "norm_mean": [0.48145466, 0.4578275, 0.40821073],
        "norm_std": [0.26862954, 0.26130258, 0.27577711],
        "patch_size": config["vision_config"]["patch_size"],
    }
