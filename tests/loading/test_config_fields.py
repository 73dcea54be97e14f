"""config.json fields of published checkpoints that change the math, through the real loader:
transformers' defaults where a field is absent, and every field of a YaRN block it reads."""

from __future__ import annotations

import json
import math

import mlx.core as mx
import numpy as np
import pytest

from kapitsa.engine.loading.loader import load_model
from tests.loading.conftest import logits_of

# Qwen3.5's model cards enable long context with this block (text_config.rope_parameters)
QWEN_YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 262144,
    "rope_theta": 10000000,
    "partial_rotary_factor": 0.25,
    "mrope_interleaved": True,
    "mrope_section": [2, 1, 1],
}


def _attention_rope(loaded):
    layer = next(layer for layer in loaded.model.layers if not layer.is_linear)
    return layer.self_attn.rope


def _transformers_yarn(dims: int, base: float, block: dict, max_positions: int) -> tuple[np.ndarray, float]:
    """transformers' `_compute_yarn_parameters` (modeling_rope_utils.py), in numpy."""
    original = block.get("original_max_position_embeddings") or max_positions
    factor = block.get("factor") or max_positions / original
    if block.get("attention_factor") is not None:
        attention = block["attention_factor"]
    elif block.get("mscale") and block.get("mscale_all_dim"):
        attention = (0.1 * block["mscale"] * math.log(factor) + 1) / (
            0.1 * block["mscale_all_dim"] * math.log(factor) + 1
        )
    else:
        attention = 0.1 * math.log(factor) + 1 if factor > 1 else 1.0
    beta_fast, beta_slow = block.get("beta_fast") or 32, block.get("beta_slow") or 1

    def correction_dim(rotations):
        return dims * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if block.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dims // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolate = 1 - ramp
    pos_freqs = base ** (np.arange(0, dims, 2, dtype=np.float32) / dims)
    inv = (1 / (factor * pos_freqs)) * (1 - extrapolate) + (1 / pos_freqs) * extrapolate
    return inv, attention


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"original_max_position_embeddings": ...},  # transformers: max_position_embeddings
        {"factor": ..., "original_max_position_embeddings": 65536},  # factor: max / original
        {"attention_factor": 1.0},
        {"mscale": 1.0, "mscale_all_dim": 0.5},
        {"truncate": False},
        {"beta_fast": None, "beta_slow": None},  # null: transformers' 32 and 1
    ],
)
def test_qwen_yarn_block_as_transformers_reads_it(tiny, changes):
    block = {k: v for k, v in {**QWEN_YARN, **changes}.items() if v is not ...}  # ...: the field is absent
    loaded = load_model(tiny("qwen3_5", rope_parameters=block, max_position_embeddings=262144))
    rope = _attention_rope(loaded)
    inv, attention = _transformers_yarn(rope.dims, 1e7, block, 262144)
    assert np.allclose(np.array(rope.inv_freq), inv, rtol=1e-5)
    assert rope.mscale == pytest.approx(attention)


def test_yarn_scales_image_positions_as_it_scales_text_positions(tiny):
    """A vision prompt's chunk rotates at per-axis positions (`MRope.at_axes`); where the three
    axes agree (text) that is the plain rope, YaRN's magnitude scale included."""
    rope = _attention_rope(load_model(tiny("qwen3_5", rope_parameters=QWEN_YARN)))
    assert rope.mscale > 1.0
    x = mx.random.normal((1, 2, 5, 32), key=mx.random.key(0))
    positions = mx.broadcast_to(mx.arange(3, 8)[None, None], (3, 1, 5))
    assert mx.allclose(rope.at_axes(x, positions), rope(x, 3), atol=1e-5).item()


def test_nemotron_moe_without_n_shared_experts_keeps_its_shared_expert(tiny):
    """transformers builds every Nemotron-H MoE block with its shared expert (n_shared_experts
    defaults to 1), so a config that leaves the field out still names a checkpoint that has one."""
    reference = logits_of(load_model(tiny("nemotron_h", "listed")))
    folder = tiny("nemotron_h", "unlisted")
    config = json.loads((folder / "config.json").read_text())
    del config["n_shared_experts"]
    (folder / "config.json").write_text(json.dumps(config))
    assert mx.array_equal(logits_of(load_model(folder)), reference).item()
