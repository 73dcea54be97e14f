"""Reading a checkpoint folder's config.json and safetensors weights, with clear errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx

from kapitsa.errors import CheckpointError, UnsupportedModel

INDEX_FILE = "model.safetensors.index.json"


def _decode_special_floats(obj: dict[str, Any]) -> Any:
    # transformers v5 writes non-finite floats as {"__float__": "Infinity"}
    if obj.keys() == {"__float__"}:
        return float(obj["__float__"])
    return obj


def read_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder} has no config.json; is it a Hugging Face or MLX model folder?")
    try:
        config = json.loads(path.read_text(encoding="utf-8"), object_hook=_decode_special_floats)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, ValueError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} does not hold a JSON object")
    return config


def _index_files(folder: Path) -> list[Path]:
    index_path = folder / INDEX_FILE
    try:
        weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index_path} is unreadable or has no weight_map: {e}") from e
    names = sorted(set(weight_map.values()))
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        raise CheckpointError(
            f"{folder} is incomplete: {len(missing)} of {len(names)} weight files named in {INDEX_FILE} "
            f"are missing (first: {missing[0]}); was the download interrupted?"
        )
    return [folder / n for n in names]


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those its index names, else every *.safetensors."""
    if (folder / INDEX_FILE).is_file():
        return _index_files(folder)
    files = sorted(p for p in folder.glob("*.safetensors") if not p.name.startswith("."))
    if files:
        return files
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")) or any(folder.glob("*.pth")):
        raise UnsupportedModel(f"{folder} holds PyTorch pickle weights only; kapitsa reads safetensors")
    if any(folder.glob("*.gguf")):
        raise CheckpointError(f"{folder} holds .gguf files; pass the path of one .gguf file")
    raise CheckpointError(f"{folder} has no *.safetensors weight files")


def load_safetensors(files: list[Path]) -> dict[str, mx.array]:
    """All tensors of `files` (lazily mapped by MLX); a duplicate name across shards is an error."""
    weights: dict[str, mx.array] = {}
    for path in files:
        try:
            part = mx.load(str(path))
        except (RuntimeError, ValueError, OSError) as e:
            raise CheckpointError(f"cannot read {path}: {e}") from e
        clash = weights.keys() & part.keys()
        if clash:
            raise CheckpointError(f"tensor {sorted(clash)[0]!r} appears in more than one weight file")
        weights.update(part)
    return weights
