"""One module per Hugging Face `model_type`. `get_model_module` maps a config to its module."""

from __future__ import annotations

import importlib
from types import ModuleType

from kapitsa.errors import UnsupportedModel

# model_type (as in config.json) -> module in this package
MODEL_TYPES: dict[str, str] = {
    "qwen3_5": "qwen3_5",
    "qwen3_5_moe": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe_text": "qwen3_5",
    "qwen3_next": "qwen3_5",
    "nemotron_h": "nemotron_h",
}


def get_model_module(model_type: str) -> ModuleType:
    name = MODEL_TYPES.get(model_type)
    if name is None:
        supported = ", ".join(sorted(MODEL_TYPES))
        raise UnsupportedModel(f"model_type {model_type!r} is not supported; kapitsa runs: {supported}")
    return importlib.import_module(f"kapitsa.engine.models.{name}")
