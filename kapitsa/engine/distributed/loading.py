"""Loading one rank's part of a checkpoint: only the tensors its shard keeps are ever read.

The whole model is built and loaded lazily (MLX maps safetensors without reading them), then cut
down to the rank's part. Pipeline: layers outside its range become empty modules, so only the
rank's layers are ever read. Tensor parallel: every tensor is sliced; a slice reads its whole
tensor, so layers are evaluated one at a time (the peak is the rank's part plus one layer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from kapitsa.engine.distributed.group import PARALLEL_MODES, Group
from kapitsa.engine.distributed.shard import layer_range
from kapitsa.engine.loading.loader import (
    build_model,
    generation_defaults,
    make_model_info,
    with_generation_defaults,
)
from kapitsa.engine.loading.quantize import foreign_quantization, parse_quant_spec
from kapitsa.engine.loading.resolve import parse_model_ref, resolve_source
from kapitsa.engine.loading.small_rule import SMALL as SMALL_TAG
from kapitsa.engine.loading.weights import load_safetensors, read_config, weight_files
from kapitsa.engine.models import get_model_module
from kapitsa.engine.text.tokenizer import Tokenizer
from kapitsa.engine.types import ModelInfo
from kapitsa.errors import InvalidRequest, UnsupportedModel


@dataclass
class LoadedShard:
    model: nn.Module
    config: dict[str, Any]
    path: Path
    layer_ids: list[int]  # the layers this rank runs
    tokenizer: Tokenizer | None = None  # rank 0 only
    info: ModelInfo | None = None  # rank 0 only
    generation_config: dict[str, Any] = field(default_factory=dict)


def load_shard(spec: str, *, group: Group, parallel: str, model_id: str | None = None) -> LoadedShard:
    """This rank's part of the checkpoint `spec` (a folder or cached repo id, optional `:4bit`).

    Raises:
        ModelNotFound, UnsupportedModel, CheckpointError, InvalidRequest.
    """
    if parallel not in PARALLEL_MODES:
        raise InvalidRequest(f"unknown --parallel {parallel!r}; choose one of {', '.join(PARALLEL_MODES)}")
    ref = parse_model_ref(spec)
    path = resolve_source(ref)
    if not path.is_dir():
        raise UnsupportedModel(f"{path}: a distributed run reads a safetensors checkpoint folder, not a file")
    config = read_config(path)
    model, quantization = _build_lazily(config, path, ref.quantization)
    layer_ids = _cut_to_shard(model, group, parallel)
    shard = LoadedShard(model, config, path, layer_ids)
    if group.is_driver:
        shard.tokenizer = Tokenizer.from_folder(path, config)
        default_id = ref.source if not Path(ref.source).expanduser().exists() else path.name
        shard.info, shard.generation_config = _describe(
            model_id or default_id, config, shard.tokenizer, path, quantization
        )
    return shard


def _describe(
    model_id: str, config: dict[str, Any], tokenizer: Tokenizer, path: Path, quantization: str | None
) -> tuple[ModelInfo, dict[str, Any]]:
    """`ModelInfo` as a single-process load reports it, and generation_config.json's sampling defaults."""
    generation = generation_defaults(path)
    info = make_model_info(model_id, config, tokenizer, path, quantization)
    return with_generation_defaults(info, generation), generation


def _build_lazily(config: dict[str, Any], path: Path, quantize: str | None) -> tuple[nn.Module, str | None]:
    """The whole model with every weight loaded lazily (nothing read yet), and its quantization."""
    get_model_module(str(config.get("model_type")))  # an unknown architecture fails before reading weights
    if (method := foreign_quantization(config, path if path.is_dir() else None)) is not None:
        raise UnsupportedModel(f"{path.name} is quantized with {method!r}; kapitsa cannot load it")
    if (
        quantize == SMALL_TAG
    ):  # its widths come from one machine's budget; a group's ranks each have their own
        raise InvalidRequest(
            "the ':small' recipe does not run across a group yet: load a quantized checkpoint"
        )
    spec = parse_quant_spec(quantize) if quantize else None
    model, description = build_model(config, load_safetensors(weight_files(path)), spec, evaluate=False)
    model.pop("vision_tower", None)  # distributed runs are text-only; its lazy weights are never read
    return model, description


def _cut_to_shard(model: nn.Module, group: Group, parallel: str) -> list[int]:
    num_layers = len(model.layers)
    model.mtp = None  # drafting heads are not split: speculation is off in a group
    if parallel == "tensor":
        from kapitsa.engine.distributed.tensor import shard_tensor_parallel

        shard_tensor_parallel(model, group)
        for layer in model.layers:  # each layer's whole tensors are read, sliced and freed in turn
            mx.eval(layer.parameters())
        return list(range(num_layers))
    if num_layers < group.size:
        raise InvalidRequest(f"{num_layers} layers cannot be split across {group.size} ranks")
    keep = layer_range(num_layers, group.rank, group.size)
    _drop_layers(model, keep)
    if not group.is_driver:  # rank 0 embeds and computes the logits
        _drop_ends(model)
    return list(keep)


def _drop_layers(model: nn.Module, keep: range) -> None:
    layers = model.layers
    for i in range(len(layers)):
        if i not in keep:
            layers[i] = nn.Module()  # an empty module: its tensors are never read


def _drop_ends(model: nn.Module) -> None:
    embed, _, norm = model.backbone_parts()
    ends = {id(embed), id(norm), id(model.head())}
    for name, sub in list(model.named_modules()):
        if id(sub) in ends and name:
            _replace(model, name, nn.Module())


def _replace(root: nn.Module, path: str, new: nn.Module) -> None:
    *parents, last = path.split(".")
    node: Any = root
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    node[last] = new
