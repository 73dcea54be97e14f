"""Turn the bf16 Qwen3.5 demo checkpoint into the MLX-quantized folder that ships as `kapitsa/demo/`.

Run with kapitsa's own environment (it uses kapitsa's loader and MLX):

    .venv/bin/python tools/tinyckpt/package_demo.py build/checkpoints/qwen35-demo kapitsa/demo --bits 4

The weights are loaded and quantized by `kapitsa.engine.loading.loader.load_model` (so the MTP head, which
kapitsa keeps, is quantized with the rest) and written as mlx-lm writes MLX checkpoints: the
sanitized parameter names, and the `quantization` block in config.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from kapitsa.engine.loading.loader import load_model
from kapitsa.engine.loading.quantize import parse_quant_spec, quantize_model

COPIED = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def package(source: Path, target: Path, bits: int) -> dict:
    loaded = load_model(source)  # as stored (bf16); quantize_model returns the config block
    block = quantize_model(loaded.model, parse_quant_spec(f"{bits}bit"))
    weights = dict(tree_flatten(loaded.model.parameters()))
    target.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(target / "model.safetensors"), weights, metadata={"format": "mlx"})
    config = json.loads((source / "config.json").read_text())
    config["quantization"] = block
    config["quantization_config"] = block
    (target / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name in COPIED:
        shutil.copyfile(source / name, target / name)
    return block


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("source", type=Path)
    parser.add_argument("target", type=Path)
    parser.add_argument("--bits", type=int, default=4, choices=(4, 6, 8))
    args = parser.parse_args()
    print(json.dumps(package(args.source, args.target, args.bits)))


if __name__ == "__main__":
    main()
