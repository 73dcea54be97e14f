"""Images in prompts: decoding, each model family's preprocessing, and where image tokens go.

`image_prompter(config, folder)` gives the object that turns a rendered prompt plus its images into
the expanded prompt ids and a `PromptMedia` (vision.media); None for a text-only checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kapitsa.errors import CheckpointError

NEMOTRON_VL_TYPES = ("nemotron_h_nano_omni", "nemotron_h_omni", "nemotronh_nano_omni_reasoning_v3")

if TYPE_CHECKING:
    from kapitsa.engine.text.prepare import ImagePrompter


def _json(folder: Path, name: str) -> dict[str, Any]:
    path = folder / name
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e
    return value if isinstance(value, dict) else {}


def image_prompter(config: dict[str, Any], folder: Path, tokenizer: Any) -> ImagePrompter | None:
    """The image preprocessing a vision-language checkpoint's processor configs describe."""
    model_type = config.get("model_type")
    if model_type in ("qwen3_5", "qwen3_5_moe"):
        from kapitsa.engine.vision.qwen import QwenImages, QwenImageSettings

        settings = QwenImageSettings.from_configs(
            _json(folder, "preprocessor_config.json"), _json(folder, "processor_config.json")
        )
        return QwenImages(settings, image_token_id=int(config.get("image_token_id", 248056)))
    if model_type in NEMOTRON_VL_TYPES:
        from kapitsa.engine.vision.nemotron import NemotronImages

        return NemotronImages.from_checkpoint(config, _json(folder, "preprocessor_config.json"), tokenizer)
    return None
