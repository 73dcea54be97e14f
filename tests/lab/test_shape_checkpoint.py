"""lab/shape_checkpoint.py: a random-weight checkpoint folder that kapitsa's loader and mlx-lm's
both load, whose greedy tokens are the same in both and always plain text (so a streaming client
sees one text chunk per token and no end of turn)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load as mlxlm_load
from mlx_lm.generate import generate_step

from kapitsa.engine.loading.loader import load_model
from lab.models_under_test import DTYPE
from lab.shape_checkpoint import family_of, text_ids, write_shape_checkpoint

PROMPT = [5, 17, 42, 99, 123, 7, 301, 11]


@pytest.fixture(autouse=True)
def _float32(monkeypatch):
    monkeypatch.setitem(DTYPE, "value", mx.float32)  # MLX's CPU gather_mm (MoE) is float32-only


def _mlxlm_tokens(folder, count: int) -> list[int]:
    model, _ = mlxlm_load(str(folder))
    steps = generate_step(mx.array(PROMPT), model, max_tokens=count)
    return [int(token) for token, _ in steps]


def _kapitsa_tokens(folder, count: int) -> list[int]:
    model = load_model(folder).model
    ids = list(PROMPT)
    for _ in range(count):  # no cache: the whole sequence each step (8 + 8 tokens, tiny widths)
        ids.append(int(mx.argmax(model(mx.array([ids]))[0, -1])))
    return ids[len(PROMPT) :]


@pytest.mark.parametrize("shape", ["4b", "nemotron-30b-a3b"])
def test_both_engines_load_it_and_write_text(tmp_path, shape: str) -> None:
    folder = write_shape_checkpoint(shape, tmp_path / shape, tiny=True)
    ours = _kapitsa_tokens(folder, 8)
    assert ours == _mlxlm_tokens(folder, 8)
    allowed = set(text_ids(family_of("nemotron_h" if "nemotron" in shape else "qwen3_5")).tolist())
    assert set(ours) <= allowed


@pytest.mark.parametrize("build", ["kapitsa", "mlx-lm"])
def test_nemotron_routers_are_random_so_tokens_spread_over_experts(build: str) -> None:
    from kapitsa.testing.tiny import tiny_config
    from lab.models_under_test import TINY, kapitsa_model, mlxlm_model, random_routers

    kind, dims = TINY["nemotron-30b-a3b"]
    config = tiny_config(kind, **dims)
    model = (kapitsa_model if build == "kapitsa" else mlxlm_model)(config)
    gates = [v for k, v in tree_flatten(model.parameters()) if k.endswith("mixer.gate.weight")]
    assert gates and all(mx.any(g).item() for g in gates)  # mlx-lm's class starts them at zero
    assert random_routers(model) == 0  # nothing left to fill
    scores = mx.random.normal((64, gates[0].shape[1])) @ gates[0].T.astype(mx.float32)
    picks = mx.argmax(scores, axis=-1)
    assert len(set(picks.tolist())) > 1  # 64 different inputs do not all pick one expert
