"""Quantization: restoring MLX-format quantized checkpoints, and quantizing float ones on load.

MLX checkpoints (as mlx-lm / the mlx-community publish them) carry
`"quantization": {"group_size": 64, "bits": 4, "mode": "affine", "<module path>": {...} | false}`;
per-module entries override the default for that module (or keep it in full precision). On load,
each module's stored tensors give its width (`stored_quantization`), whatever names the table uses.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from kapitsa.errors import CheckpointError, InvalidRequest


@dataclass(frozen=True, slots=True)
class QuantSpec:
    """How to store the weights: `mode`/`bits`/`group_size` for quantized, or a float `dtype`."""

    name: str  # "4bit", "mxfp4", "bf16", ...
    mode: str = "affine"
    bits: int = 0
    group_size: int = 0
    dtype: str | None = None  # set for float-only specs ("bfloat16", "float16", "float32")
    is_recipe: bool = False  # widths chosen per module on load (`small`: loading/small.py)

    @property
    def is_quantized(self) -> bool:
        return self.dtype is None


QUANT_SPECS: dict[str, QuantSpec] = {
    **{f"{b}bit": QuantSpec(f"{b}bit", "affine", b, 64) for b in (2, 3, 4, 5, 6, 8)},
    "mxfp4": QuantSpec("mxfp4", "mxfp4", 4, 32),
    "nvfp4": QuantSpec("nvfp4", "nvfp4", 4, 16),
    "mxfp8": QuantSpec("mxfp8", "mxfp8", 8, 32),
    "small": QuantSpec("small", "affine", 2, 64, is_recipe=True),
    "bf16": QuantSpec("bf16", dtype="bfloat16"),
    "fp16": QuantSpec("fp16", dtype="float16"),
    "fp32": QuantSpec("fp32", dtype="float32"),
}


def parse_quant_spec(name: str) -> QuantSpec:
    spec = QUANT_SPECS.get(name.strip().lower())
    if spec is None:
        raise InvalidRequest(f"unknown quantization {name!r}; choose one of: {', '.join(QUANT_SPECS)}")
    return spec


def checkpoint_quantization(config: Mapping[str, Any]) -> dict[str, Any] | None:
    """The MLX `quantization` block of a config, if the checkpoint is MLX-quantized."""
    block = config.get("quantization")
    if isinstance(block, dict) and "bits" in block:
        return block
    block = config.get("quantization_config")
    if not (isinstance(block, dict) and "bits" in block and "group_size" in block):
        return None
    # AutoRound's MLX export names its quantizer and says its tensors are MLX-packed
    mlx_packed = "quant_method" not in block or str(block.get("packing_format", "")).lower() == "mlx"
    return block if mlx_packed else None


def foreign_quantization(config: Mapping[str, Any], folder: Path | None = None) -> str | None:
    """The method of a non-MLX quantized checkpoint (fp8, gptq, awq, modelopt...), if any; with
    `folder`, also one named only by NVIDIA ModelOpt's side file `hf_quant_config.json`.

    A checkpoint whose tensors are MLX-packed is not foreign even when it names its quantizer:
    AutoRound's MLX export writes `quantization_config: {quant_method: auto-round, packing_format:
    mlx}` beside the MLX `quantization` block, which decides, as it does for mlx-lm."""
    holders = (config, config.get("text_config") or {})
    if any(checkpoint_quantization(h) is not None for h in holders):
        return None
    for holder in holders:
        block = holder.get("quantization_config")
        if isinstance(block, dict) and block.get("quant_method"):
            return str(block["quant_method"])
    return _modelopt_side_file(folder) if folder is not None else None


def _modelopt_side_file(folder: Path) -> str | None:
    """`modelopt (<quant_algo>)` when `folder` holds ModelOpt's `hf_quant_config.json`."""
    path = folder / "hf_quant_config.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return "modelopt"
    quant = data.get("quantization") if isinstance(data, dict) else None
    algo = quant.get("quant_algo") if isinstance(quant, dict) else None
    return f"modelopt ({algo})" if isinstance(algo, str) and algo else "modelopt"


def describe_quantization(block: Mapping[str, Any]) -> str:
    mode = block.get("mode", "affine")
    return f"{block['bits']}bit" if mode == "affine" else str(mode)


# Modes other than affine store uint8 scales and allow one (bits, group size) each.
_PACKED_MODES = {
    (s.bits, s.group_size): s.mode for s in QUANT_SPECS.values() if s.is_quantized and s.mode != "affine"
}


def stored_quantization(path: str, module: nn.Module, weights: Mapping[str, mx.array]) -> dict[str, Any]:
    """The group size, bits and mode `path`'s stored tensors were packed with, read from their shapes.

    The packed shapes decide, not the config's per-module table: mixed-precision exports (Intel's
    AutoRound MLX builds of Qwen3.5/3.6) key that table by checkpoint tensor names
    (`model.language_model.layers.0...`), not by module paths, so a lookup misses and the top-level
    default would build the module at the wrong width."""
    scales, packed = weights[f"{path}.scales"], weights[f"{path}.weight"]
    in_dims = module.weight.shape[-1]
    group_size, bits = in_dims // scales.shape[-1], packed.shape[-1] * 32 // in_dims
    if scales.dtype != mx.uint8:
        return {"group_size": group_size, "bits": bits, "mode": "affine"}
    mode = _PACKED_MODES.get((bits, group_size))
    if mode is None:
        raise CheckpointError(
            f"{path} is stored quantized at {bits} bits in groups of {group_size}: no MLX mode"
        )
    return {"group_size": group_size, "bits": bits, "mode": mode}


def restore_checkpoint_quantization(
    model: nn.Module, block: Mapping[str, Any], weights: Mapping[str, mx.array]
) -> None:
    """Turn the modules the checkpoint stores quantized into quantized modules (before loading),
    each at the width its stored tensors have; the others stay float (a per-module `False`)."""

    def predicate(path: str, module: nn.Module) -> bool | dict:
        if hasattr(module, "to_quantized") and f"{path}.scales" in weights and f"{path}.weight" in weights:
            return stored_quantization(path, module, weights)
        return False

    nn.quantize(
        model,
        group_size=block.get("group_size"),
        bits=block["bits"],
        mode=block.get("mode", "affine"),
        class_predicate=predicate,
    )


def _model_predicate(model: nn.Module) -> Callable[[str, nn.Module], bool | dict]:
    hook = getattr(model, "quant_predicate", None)
    return hook if callable(hook) else (lambda path, module: True)


def quantize_model(model: nn.Module, spec: QuantSpec) -> dict[str, Any]:
    """Quantize a loaded float model in place; return the config `quantization` block that
    describes the result (the form MLX checkpoints store)."""
    allowed = _model_predicate(model)
    overrides: dict[str, Any] = {}

    def predicate(path: str, module: nn.Module) -> bool | dict:
        if not hasattr(module, "to_quantized") or module.weight.shape[-1] % spec.group_size:
            return False
        verdict = allowed(path, module)
        if verdict is not True:
            overrides[path] = verdict
        return verdict

    nn.quantize(model, group_size=spec.group_size, bits=spec.bits, mode=spec.mode, class_predicate=predicate)
    return {"group_size": spec.group_size, "bits": spec.bits, "mode": spec.mode, **overrides}


def cast_model(model: nn.Module, dtype: str) -> None:
    """Cast floating parameters to `dtype`, except those the model keeps in float32 (`cast_predicate`)."""
    target = getattr(mx, dtype)
    keep: Callable[[str], bool] = getattr(model, "cast_predicate", lambda path: True)
    params = [
        (path, value.astype(target) if mx.issubdtype(value.dtype, mx.floating) and keep(path) else value)
        for path, value in tree_flatten(model.parameters())
    ]
    model.update(tree_unflatten(params))
