"""The weight bytes one decode token reads at batch 1, for the bandwidth figures of the H200 bench.

A model's total size overstates what a token reads in two places: the input embedding table
(one row per token, unless the output projection is tied to it and reads it whole) and an MoE
layer's routed-expert stacks (only the token's top k of E experts). A vision tower is read only
while an image is encoded, never by a decode step. Everything else (projections, norms, routers,
shared experts, the output projection) is read once per token.

    python lab/weight_reads.py            # per shape: total and read-per-token GB, no weights made

The models are built lazily (MLX evaluates nothing until asked), so the figures for the full
shapes come from the parameters' shapes in a second, on any machine.
"""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn

from kapitsa.engine.models import get_model_module
from kapitsa.testing.tiny import tiny_config
from lab.models_under_test import SHAPES, quantizable

ROUTED_STACK = ".switch_mlp."  # both families' routed experts, stacked [E, out, in] (mlx-lm's names)
# the image path of Qwen3.5's tower and of Nemotron-H VL's RADIO tower + projector
IMAGE_PARTS = ("vision_tower.", "vision_model.", "mlp1.", "vision_final_layernorm")


def routing(config: dict) -> tuple[int, int] | None:
    """(experts, experts per token) of an MoE config (Qwen's nest under text_config), None for a
    dense one."""
    config = config.get("text_config") or config
    experts = config.get("num_experts") or config.get("n_routed_experts")
    return (experts, config["num_experts_per_tok"]) if experts else None


def _embedding_paths(model: nn.Module) -> list[str]:
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Embedding | nn.QuantizedEmbedding)
    ]


def _has_output_projection(model: nn.Module) -> bool:
    return any(name.split(".")[-1] == "lm_head" for name, _ in model.named_modules())


def read_bytes_per_token(model: nn.Module, route: tuple[int, int] | None) -> int:
    """Bytes of weights a batch-1 decode step reads (see the module docstring)."""
    embeddings = tuple(path + "." for path in _embedding_paths(model))
    untied = _has_output_projection(model)
    total = 0.0
    for path, value in nn.utils.tree_flatten(model.parameters()):
        nbytes = value.nbytes
        if path.startswith(IMAGE_PARTS):
            continue
        if untied and path.startswith(embeddings):
            nbytes /= value.shape[0]  # one row of the table (rows are the vocabulary)
        elif route and ROUTED_STACK in path and value.ndim == 3 and value.shape[0] == route[0]:
            nbytes *= route[1] / route[0]
        total += nbytes
    return round(total)


def total_bytes(model: nn.Module) -> int:
    return sum(v.nbytes for _, v in nn.utils.tree_flatten(model.parameters()))


def image_tower_bytes(model: nn.Module) -> int:
    """Bytes of the weights that only encode images (0 for a text model)."""
    return sum(v.nbytes for k, v in nn.utils.tree_flatten(model.parameters()) if k.startswith(IMAGE_PARTS))


def _lazy_model(kind: str, dims: dict) -> tuple[nn.Module, dict]:
    """The bench's 4-bit model of a shape, unevaluated (shapes and dtypes only), and its config."""
    config = tiny_config(kind, **dims)
    module = get_model_module(config["model_type"])
    model = module.Model(module.ModelArgs.from_dict(config))
    model.set_dtype(mx.bfloat16)
    nn.quantize(model, group_size=64, bits=4, class_predicate=quantizable)
    return model, config


def main() -> None:
    for name, (kind, dims) in SHAPES.items():
        model, config = _lazy_model(kind, dims)
        print(
            json.dumps(
                dict(
                    shape=name,
                    weights_gb=round(total_bytes(model) / 1e9, 3),
                    read_gb_per_token=round(read_bytes_per_token(model, routing(config)) / 1e9, 3),
                )
            )
        )


if __name__ == "__main__":
    main()
