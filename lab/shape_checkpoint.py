"""A random-weight 4-bit checkpoint folder of a real shape that both `kapitsa serve` and
`mlx_lm.server` load, so the servers can be timed as users meet them (an HTTP client streaming).

    python lab/shape_checkpoint.py 27b /tmp/shape-27b          # the published shape (GBs on disk)
    python lab/shape_checkpoint.py 27b /tmp/shape-27b --tiny   # the same architecture, small widths

The weights are mlx-lm's model of the shape (lab/models_under_test.py), quantized as the decode
bench quantizes them and saved in mlx-lm's layout (`quantization` in config.json), beside the tiny
test tokenizer and chat template (kapitsa/testing/tiny_tokenizer.py). A random model's greedy
token is almost never one that tokenizer can spell, and a stream of unspellable ids sends no
text; so the output projection's rows of every id outside the tokenizer's plain text tokens are
zeroed (their logits are 0, below the best of ~480 random ones). The projection still reads all
its rows: the work per token is the shape's own, and no special token (end of turn) comes out,
so every request decodes its whole `max_tokens`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from kapitsa.testing.tiny import tiny_config
from kapitsa.testing.tiny_tokenizer import (
    chat_template_for,
    dumps,
    generation_config,
    token_ids,
    tokenizer_config,
    tokenizer_json,
    vocab_length,
)
from lab.models_under_test import SHAPES, TINY, mlxlm_model

GROUP_SIZE, BITS = 64, 4  # as models_under_test.materialize quantizes


def family_of(kind: str) -> str:
    return "nemotron" if kind.startswith("nemotron") else "qwen"


def text_ids(family: str) -> mx.array:
    """The tokenizer's ids that decode to plain text (not special, not added)."""
    reserved = set(token_ids(family).values())
    return mx.array([i for i in range(vocab_length(family)) if i not in reserved])


def _output_projection(model: nn.Module) -> nn.Module:
    """The module whose rows are the vocabulary's logits (lm_head, or the tied embedding)."""
    for name, module in model.named_modules():
        if name.split(".")[-1] == "lm_head":
            return module
    return next(m for n, m in model.named_modules() if n.split(".")[-1] in ("embed_tokens", "embeddings"))


def keep_only_rows(projection: nn.Module, keep: mx.array) -> None:
    """Zero every row of a (quantized) projection but `keep`: its dequantized weight is 0 there."""
    rows = projection.weight.shape[0]
    mask = mx.zeros((rows, 1), dtype=mx.bool_)
    mask[keep] = True
    names = ("scales", "biases") if "scales" in projection else ("weight",)
    for name in names:
        value = getattr(projection, name)
        setattr(projection, name, mx.where(mask, value, mx.zeros_like(value)))
    mx.eval(projection.parameters())


def write_shape_checkpoint(shape: str, folder: Path, *, tiny: bool = False) -> Path:
    kind, dims = (TINY if tiny else SHAPES)[shape]
    config = tiny_config(kind, **dims)
    config.pop("vision_config", None)  # text only: the servers are timed on text
    family = family_of(kind)
    model = mlxlm_model(config)
    keep_only_rows(_output_projection(model), text_ids(family))
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(
        str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())), {"format": "mlx"}
    )
    config["quantization"] = config["quantization_config"] = {"group_size": GROUP_SIZE, "bits": BITS}
    (folder / "config.json").write_text(dumps(config))
    (folder / "generation_config.json").write_text(dumps(generation_config(family)))
    (folder / "tokenizer.json").write_text(tokenizer_json(family))
    (folder / "tokenizer_config.json").write_text(
        dumps(tokenizer_config(family, template=chat_template_for(kind)))
    )
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("folder", type=Path)
    parser.add_argument("--tiny", action="store_true", help="small widths (a smoke run on any machine)")
    args = parser.parse_args()
    if args.tiny:
        from lab.models_under_test import DTYPE

        DTYPE["value"] = mx.float32  # MLX's CPU gather_mm (MoE) is float32-only
    folder = write_shape_checkpoint(args.shape, args.folder, tiny=args.tiny)
    size = sum(p.stat().st_size for p in folder.iterdir())
    print(json.dumps({"shape": args.shape, "folder": str(folder), "bytes": size}))


if __name__ == "__main__":
    main()
