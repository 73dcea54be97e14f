"""tiny.py writes checkpoints in the published Hugging Face shape: transformers loads them with no
missing or unexpected tensors, and its own save_pretrained writes the same names and shapes."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors import safe_open

from kapitsa.testing.tiny import KINDS, tiny_weights, write_tiny_checkpoint

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

_CLASSES = {
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    "qwen3_next": "Qwen3NextForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
    "nemotron_h_dense": "NemotronHForCausalLM",
}


def _shapes_on_disk(folder):
    shapes = {}
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "np") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


_VARIANTS = [(kind, True, {}) for kind in KINDS] + [
    ("qwen3_5_moe", False, {}),  # re-saved copies: per-expert tensors
    ("nemotron_h", True, {"moe_latent_size": 32}),  # latent MoE of the larger Nemotron-3 models
    ("qwen3_5", True, {"tie_word_embeddings": True}),  # the small Qwen3.5 models tie embeddings
    ("nemotron_h", True, {"layers_block_type": ["mamba", "moe", "attention", "mlp"]}),  # newer spelling
]


@pytest.mark.parametrize(("kind", "fused_experts", "overrides"), _VARIANTS)
def test_transformers_loads_tiny_checkpoint_without_missing_or_unexpected_tensors(
    tmp_path, kind, fused_experts, overrides
):
    folder = write_tiny_checkpoint(
        tmp_path / kind, kind, vision=kind.startswith("qwen3_5"), fused_experts=fused_experts, **overrides
    )
    cls = getattr(transformers, _CLASSES[kind])
    model, info = cls.from_pretrained(folder, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"], info["missing_keys"]
    assert not info["unexpected_keys"], info["unexpected_keys"]
    assert not info["mismatched_keys"], info["mismatched_keys"]

    model.save_pretrained(tmp_path / "resaved")
    ours, theirs = _shapes_on_disk(folder), _shapes_on_disk(tmp_path / "resaved")
    assert ours == theirs


@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h"])
def test_transformers_sees_the_same_values(tmp_path, kind):
    folder = write_tiny_checkpoint(tmp_path, kind)
    model = getattr(transformers, _CLASSES[kind]).from_pretrained(folder, dtype=torch.float32)
    state = model.state_dict()
    name = (
        "model.language_model.layers.0.linear_attn.in_proj_qkv.weight"
        if kind == "qwen3_5"
        else "model.layers.0.mixer.in_proj.weight"
    )
    source = (
        "model.language_model.layers.0.linear_attn.in_proj_qkv.weight"
        if kind == "qwen3_5"
        else "backbone.layers.0.mixer.in_proj.weight"
    )
    expected = tiny_weights(json.loads((folder / "config.json").read_text()))[source]
    np.testing.assert_array_equal(state[name].numpy(), expected)
