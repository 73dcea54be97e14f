"""Writing checkpoint folders: transformers' save_pretrained (bf16) plus tokenizer, chat template and the
config keys that published checkpoints carry and transformers 5 spells differently."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from torch import nn

from .tokenizer import EOS_TOKEN, PAD_TOKEN, write_tokenizer_files

WEIGHTS = "model.safetensors"


def generation_config(tokenizer: Tokenizer) -> dict:
    eos, pad = tokenizer.token_to_id(EOS_TOKEN), tokenizer.token_to_id(PAD_TOKEN)
    # A tiny model loops under pure greedy decoding; a low temperature keeps it on topic.
    return {
        "bos_token_id": None,
        "eos_token_id": [eos, pad],
        "pad_token_id": pad,
        "do_sample": True,
        "temperature": 0.3,
        "top_k": 20,
        "top_p": 0.9,
        # A tiny model can loop, and an agent's turn must end: past 128 tokens the end of the answer
        # grows likelier (Hugging Face's length penalty); 512 tokens when a request sets no limit.
        "exponential_decay_length_penalty": [128, 1.05],
        "max_new_tokens": 512,
    }


def _patch_config(folder: Path, updates: dict, drop: tuple[str, ...] = ()) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key in drop:
        config.pop(key, None)
    config.update(updates)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def save_checkpoint(model: nn.Module, folder: Path, tokenizer: Tokenizer) -> None:
    model.to(torch.bfloat16).save_pretrained(folder)
    write_tokenizer_files(tokenizer, folder)
    (folder / "generation_config.json").write_text(json.dumps(generation_config(tokenizer), indent=2) + "\n")
    if model.config.model_type == "nemotron_h":
        # Published Nemotron-H configs describe the layers with `hybrid_override_pattern` (mlx-lm and
        # llama.cpp read it); transformers 5 writes `layers_block_type`. Keep both. Its infinite
        # `time_step_limit` has no JSON spelling (transformers 5 writes {"__float__": "Infinity"}), and
        # the default is that same (0, inf): leave the key out.
        _patch_config(
            folder,
            {
                "hybrid_override_pattern": model.config.hybrid_override_pattern,
                "num_hidden_layers": model.config.num_hidden_layers,
            },
            drop=("time_step_limit",),
        )


def add_mtp_weights(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    weights = load_file(folder / WEIGHTS)
    weights.update({name: t.detach().to(torch.bfloat16).cpu().contiguous() for name, t in tensors.items()})
    save_file(weights, folder / WEIGHTS, metadata={"format": "pt"})
    _patch_config(folder, {"mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False})


def load_mtp_weights(folder: Path) -> dict[str, torch.Tensor]:
    weights = load_file(folder / WEIGHTS)
    return {name.removeprefix("mtp."): t for name, t in weights.items() if name.startswith("mtp.")}
