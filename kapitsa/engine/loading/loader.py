"""`load_model`: from a folder, a cached Hugging Face repo id or a .gguf file to a ready model.

Formats: Hugging Face safetensors (single or sharded), MLX checkpoints as mlx-lm writes them
(quantized with a `quantization` block), and GGUF. Float checkpoints can be quantized on load
(`quantize="4bit"` or a `MODEL:4bit` suffix). Any failure raises a `KapitsaError` subclass before
anything is returned; nothing global is touched, so a failed load leaves no state behind.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from kapitsa.engine.loading.quantize import (
    QuantSpec,
    cast_model,
    checkpoint_quantization,
    describe_quantization,
    foreign_quantization,
    parse_quant_spec,
    quantize_model,
    restore_checkpoint_quantization,
)
from kapitsa.engine.loading.resolve import ModelRef, parse_model_ref, pick_gguf, resolve_source
from kapitsa.engine.loading.small import apply_small, device_budget, plan_small
from kapitsa.engine.loading.weights import load_safetensors, read_config, weight_files
from kapitsa.engine.models import get_model_module
from kapitsa.engine.text.thinking_probe import probe_thinking
from kapitsa.engine.text.tokenizer import Tokenizer
from kapitsa.engine.types import ModelInfo
from kapitsa.engine.vision import image_prompter
from kapitsa.errors import CheckpointError, InvalidRequest, UnsupportedModel

_MAX_ERROR_CHARS = 600


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: nn.Module
    tokenizer: Tokenizer
    config: dict[str, Any]  # config.json as published (for GGUF: rebuilt from its metadata)
    path: Path
    info: ModelInfo
    # generation_config.json (the publisher's sampling defaults: temperature, top_p, top_k...); {} if none
    generation_config: dict[str, Any] = field(default_factory=dict)
    # turns image placeholders into image tokens (kapitsa.engine.vision); None for text-only models
    images: Any = None


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a config (vision-language checkpoints nest it under `text_config`
    or `llm_config`)."""
    nested = config.get("text_config", config.get("llm_config"))
    return nested if isinstance(nested, dict) else config


def _requested_quantization(ref: ModelRef, quantize: str | None) -> QuantSpec | None:
    if quantize and ref.quantization and quantize.lower() != ref.quantization:
        raise InvalidRequest(f"two quantizations asked for: {quantize!r} and the suffix {ref.quantization!r}")
    name = quantize or ref.quantization
    return parse_quant_spec(name) if name else None


def build_model(
    config: dict[str, Any],
    weights: dict[str, mx.array],
    quant: QuantSpec | None,
    *,
    memory_budget: int | None = None,
    evaluate: bool = True,
) -> tuple[nn.Module, str | None]:
    """Instantiate the model for `config`, load `weights` (Hugging Face or MLX names), quantize.

    `weights` is consumed (emptied): with no other reference to the lazy float tensors, MLX frees
    each one as soon as its quantized form is computed, so quantizing on load never holds the
    whole float model in memory. `memory_budget` (bytes) picks the `small` recipe's widths.
    `evaluate=False` leaves every weight lazy (nothing read yet): a distributed rank keeps only its
    shard and reads only that.

    Returns:
        The evaluated model and a description of its quantization ("4bit", "bf16", "small-2/4", None).
    """
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise CheckpointError("config.json has no model_type")
    module = get_model_module(model_type)
    try:
        model = module.Model(module.ModelArgs.from_dict(config))
        sanitized = model.sanitize(dict(weights))
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(
            f"config.json and the weights do not describe a {model_type} model: {e!r}"
        ) from e
    stored = checkpoint_quantization(config)
    if stored is not None:
        if (
            quant is not None
            and not quant.is_recipe
            and (not quant.is_quantized or quant.name != describe_quantization(stored))
        ):
            raise InvalidRequest(
                f"this checkpoint is already quantized ({describe_quantization(stored)}); "
                f"it cannot be loaded as {quant.name}"
            )
        restore_checkpoint_quantization(model, stored, sanitized)
    weights.clear()
    _load_weights(model, sanitized)
    sanitized.clear()
    description = describe_quantization(stored) if stored else None
    if quant is not None and quant.is_recipe:
        plan = plan_small(model, memory_budget if memory_budget is not None else device_budget())
        apply_small(model, plan)
        description = plan.description
    elif quant is not None and stored is None:
        if quant.is_quantized:
            quantize_model(model, quant)
        else:
            cast_model(model, quant.dtype or "bfloat16")
        description = quant.name
    if evaluate:
        mx.eval(model.parameters())
    model.eval()
    return model, description


def _load_weights(model: nn.Module, weights: dict[str, mx.array]) -> None:
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        message = str(e)
        if len(message) > _MAX_ERROR_CHARS:
            message = message[:_MAX_ERROR_CHARS] + " ..."
        raise CheckpointError(f"the weights do not match config.json: {message}") from e


def _family(config: dict[str, Any]) -> str:
    return "nemotron_h" if str(config.get("model_type", "")).startswith("nemotron") else "qwen3_5"


def _tool_call_format(family: str, template: str | None) -> str:
    if family == "nemotron_h":
        return "nemotron"
    if template and "<function=" in template:
        return "qwen3_coder"
    return "hermes"


def make_model_info(
    model_id: str, config: dict[str, Any], tokenizer: Tokenizer, path: Path, quantization: str | None
) -> ModelInfo:
    family = _family(config)
    template = tokenizer.chat_template
    context_length = int(text_config(config).get("max_position_embeddings") or 0) or 4096
    return ModelInfo(
        id=model_id,
        family=family,
        context_length=context_length,
        max_output_tokens=context_length,
        tool_call_format=_tool_call_format(family, template),
        supports_thinking=bool(template) and ("<think>" in template or "enable_thinking" in template),
        thinking_prompt=probe_thinking(tokenizer),
        max_token_bytes=tokenizer.max_token_bytes(),
        path=str(path),
        quantization=quantization,
    )


def _load_folder(
    folder: Path, quant: QuantSpec | None, budget: int | None
) -> tuple[nn.Module, Tokenizer, dict[str, Any], str | None]:
    config = read_config(folder)
    get_model_module(str(config.get("model_type")))  # an unknown architecture fails before reading weights
    if (method := foreign_quantization(config, folder)) is not None:
        raise UnsupportedModel(
            f"{folder.name} is quantized with {method!r}; kapitsa loads bf16/fp16 checkpoints (quantizing them "
            "on load), MLX-quantized checkpoints and GGUF files"
        )
    tokenizer = Tokenizer.from_folder(folder, config)
    weights = load_safetensors(weight_files(folder))
    model, quantization = build_model(config, weights, quant, memory_budget=budget)
    return model, tokenizer, config, quantization


def _load_gguf_file(
    path: Path, quant: QuantSpec | None, budget: int | None
) -> tuple[nn.Module, Tokenizer, dict[str, Any], str | None]:
    from kapitsa.engine.gguf.reader import read_gguf

    checkpoint = read_gguf(path)
    suggested = checkpoint.suggested_quantization
    requested = quant or (parse_quant_spec(suggested) if suggested else None)
    model, quantization = build_model(  # empties weights
        checkpoint.config, checkpoint.weights, requested, memory_budget=budget
    )
    return model, checkpoint.tokenizer, checkpoint.config, quantization


def _has_safetensors(folder: Path) -> bool:
    return any(folder.glob("*.safetensors")) or (folder / "model.safetensors.index.json").is_file()


def load_model(
    spec: str | Path,
    *,
    quantize: str | None = None,
    model_id: str | None = None,
    memory_budget: int | None = None,
) -> LoadedModel:
    """Load a model ready to run.

    Args:
        spec: a checkpoint folder, a .gguf file, or a Hugging Face repo id found in the local cache;
            an optional `:4bit` / `:6bit` / `:8bit` / `:bf16` / `:mxfp4` ... suffix quantizes on load,
            `:small` applies the small-Mac recipe to a MoE model (routed experts 2-bit, the rest 3-6
            bit by `memory_budget`), and in a folder of .gguf files another suffix picks the file
            (`org/repo-GGUF:Q4_K_M`).
        quantize: the same as the suffix ("4bit", "bf16", "small", ...); both may be given only if
            they agree.
        model_id: the id reported in `ModelInfo` (default: the repo id, or the folder/file name).
        memory_budget: bytes the model may use, for `:small` (default: what the device reports).
    Returns:
        The model, its tokenizer, its config, the path it came from and its `ModelInfo`.
    Raises:
        ModelNotFound, UnsupportedModel, CheckpointError, InvalidRequest (NoRoutedExperts: `:small`
        on a dense model).
    """
    ref = parse_model_ref(str(spec))
    quant = _requested_quantization(ref, quantize)
    path = resolve_source(ref)
    if path.is_dir() and not _has_safetensors(path):  # a GGUF repo (it may carry a config.json too)
        path = pick_gguf(path, ref.variant) or path
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise UnsupportedModel(
                f"{path} is a file but not a .gguf; pass a checkpoint folder or a .gguf file"
            )
        model, tokenizer, config, quantization = _load_gguf_file(path, quant, memory_budget)
    else:
        model, tokenizer, config, quantization = _load_folder(path, quant, memory_budget)
    default_id = ref.source if not Path(ref.source).expanduser().exists() else path.name
    info = make_model_info(model_id or default_id, config, tokenizer, path, quantization)
    generation = generation_defaults(path) if path.is_dir() else {}
    takes_images = path.is_dir() and getattr(model, "takes_images", False)
    images = image_prompter(config, path, tokenizer) if takes_images else None
    info = dataclasses.replace(with_generation_defaults(info, generation), vision=images is not None)
    return LoadedModel(model, tokenizer, config, path, info, generation, images)


def with_generation_defaults(info: ModelInfo, generation: dict[str, Any]) -> ModelInfo:
    """`info` with the answer length and EOS decay its generation_config.json sets."""
    return dataclasses.replace(
        info,
        max_output_tokens=_output_limit(info.context_length, generation),
        eos_decay=_eos_decay(generation),
    )


def _output_limit(context_length: int, generation: dict[str, Any]) -> int:
    """The answer length a request that sets none gets: the window, or the checkpoint's
    generation_config.json `max_new_tokens` (Hugging Face's default for generate())."""
    limit = generation.get("max_new_tokens")
    if isinstance(limit, int) and not isinstance(limit, bool) and 0 < limit < context_length:
        return limit
    return context_length


def _eos_decay(generation: dict[str, Any]) -> tuple[int, float] | None:
    """generation_config.json's `exponential_decay_length_penalty` ([start, factor]), if well formed."""
    value = generation.get("exponential_decay_length_penalty")
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        return None
    start, factor = value
    if isinstance(start, bool) or not isinstance(start, int) or not isinstance(factor, (int, float)):
        return None
    return (start, float(factor)) if start >= 0 and factor >= 1.0 else None


def generation_defaults(folder: Path) -> dict[str, Any]:
    """A checkpoint folder's generation_config.json (the publisher's sampling defaults); {} if none."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e
    return value if isinstance(value, dict) else {}
