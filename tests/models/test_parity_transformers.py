"""Our models against transformers' PyTorch implementations (slow: `pip install torch==2.13.0`,
then `pytest -m slow tests/models/test_parity_transformers.py`; skipped without torch).

The weights are saved as a real checkpoint folder (config.json + safetensors with the published
tensor names) and loaded by `from_pretrained`, so transformers applies its own name mapping.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from kapitsa.engine.models import get_model_module
from tests.models.hf_weights import nemotron_config, nemotron_weights, qwen_config, qwen_weights

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow
PROMPT = [3, 17, 42, 99, 7, 250, 11, 64, 5, 8, 13, 200]


def _case(arch: str) -> tuple[dict, dict]:
    if arch.startswith("nemotron"):
        cfg = nemotron_config(arch.split("_")[1])
        # transformers clamps dt at time_step_min; the configs' time_step_limit (what mlx-lm, vLLM and
        # we follow) starts at 0. Setting it to 0 compares everything else.
        cfg["time_step_min"] = 0.0
        return cfg, nemotron_weights(cfg)
    kind = {"qwen3_5_dense": "dense", "qwen3_5_moe": "moe", "qwen3_next": "next"}[arch]
    cfg = qwen_config(kind)
    cfg = cfg.get("text_config", cfg)  # the text-only causal LM classes
    return cfg, qwen_weights(cfg, fused_experts=kind == "moe")


ARCHS = ["qwen3_5_dense", "qwen3_5_moe", "qwen3_next", "nemotron_moe", "nemotron_latent", "nemotron_dense"]


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_and_greedy_match_transformers(arch, tmp_path):
    cfg, weights = _case(arch)
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, torch_dtype="float32")))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), weights, metadata={"format": "pt"})
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()

    module = get_model_module(cfg["model_type"])
    ours = module.Model(module.ModelArgs.from_dict(cfg))
    ours.load_weights(list(ours.sanitize(dict(weights)).items()), strict=True)

    with torch.no_grad():
        want = ref(torch.tensor([PROMPT])).logits.numpy()
    got = np.array(ours(mx.array([PROMPT])))
    assert np.abs(got - want).max() < 1e-4

    with torch.no_grad():
        gen = ref.generate(torch.tensor([PROMPT]), max_new_tokens=32, do_sample=False, min_new_tokens=32)
    want_tokens = gen[0, len(PROMPT) :].tolist()
    cache, tokens = ours.make_cache(), []
    logits = ours(mx.array([PROMPT]), cache)[0, -1]
    for _ in range(32):
        tokens.append(int(mx.argmax(logits).item()))
        logits = ours(mx.array([[tokens[-1]]]), cache)[0, -1]
    assert tokens == want_tokens
