"""One module per Hugging Face `model_type`. `get_model_module` maps a config to its module."""

from __future__ import annotations

from types import ModuleType

from kapitsa.engine.models import flint, nemotron_h, nemotron_h_vision, qwen3_5, qwen3_5_vision
from kapitsa.errors import UnsupportedModel

# model_type (as in config.json) -> the module that builds it
MODEL_TYPES: dict[str, ModuleType] = {
    "qwen3_5": qwen3_5_vision,  # published with a vision tower
    "qwen3_5_moe": qwen3_5_vision,
    "qwen3_5_text": qwen3_5,
    "qwen3_5_moe_text": qwen3_5,
    "qwen3_next": qwen3_5,
    "nemotron_h": nemotron_h,
    "flint": flint,
    # vision-language Nemotron-H (the Super-VL class), in mlx-vlm's omni layout
    "nemotron_h_nano_omni": nemotron_h_vision,
    "nemotron_h_omni": nemotron_h_vision,
    "nemotronh_nano_omni_reasoning_v3": nemotron_h_vision,
}


def get_model_module(model_type: str) -> ModuleType:
    module = MODEL_TYPES.get(model_type)
    if module is None:
        supported = ", ".join(sorted(MODEL_TYPES))
        raise UnsupportedModel(f"model_type {model_type!r} is not supported; kapitsa runs: {supported}")
    return module
