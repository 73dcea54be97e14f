"""The loader helper's tiny checkpoints (published tensor layouts) load strictly into our models."""

from __future__ import annotations

import mlx.core as mx
import pytest

from kapitsa.engine.models import get_model_module
from kapitsa.testing import tiny

VARIANTS = [
    ("qwen3_5", {"mtp": True, "vision": True}),
    ("qwen3_5", {}),
    ("qwen3_5_moe", {"mtp": True, "vision": True, "fused_experts": True}),
    ("qwen3_5_moe", {"fused_experts": False}),
    ("qwen3_next", {"mtp": True, "fused_experts": False}),
    ("nemotron_h", {}),
    ("nemotron_h_dense", {}),
]


@pytest.mark.parametrize(("kind", "options"), VARIANTS)
def test_tiny_checkpoint_loads_and_decodes(kind, options):
    config = tiny.tiny_config(kind)
    weights = {k: mx.array(v) for k, v in tiny.tiny_weights(config, **options).items()}
    module = get_model_module(config["model_type"])
    model = module.Model(module.ModelArgs.from_dict(config))
    model.load_weights(list(model.sanitize(weights).items()), strict=True)
    assert (getattr(model, "mtp", None) is not None) == bool(options.get("mtp"))
    cache = model.make_cache()
    prefill = model(mx.array([[1, 2, 3, 4]]), cache)
    step = model(mx.array([[5]]), cache)
    whole = model(mx.array([[1, 2, 3, 4, 5]]))
    assert prefill.shape == (1, 4, tiny.TINY_VOCAB_SIZE)
    assert mx.abs(step[0, -1] - whole[0, -1]).max().item() < 1e-4
