"""A long forward on a GPU runs layer by layer (models/base.py `_queue_layer`): the same values as
one graph, each layer sent to the device, short forwards left as one graph."""

from __future__ import annotations

import mlx.core as mx
import pytest

from kapitsa.engine.models import base
from tests.models.builders import build_ours


@pytest.mark.parametrize("arch", ["qwen3_5_dense", "nemotron_moe"])
def test_layer_by_layer_gives_the_one_graph_values(arch: str, monkeypatch) -> None:
    model = build_ours(arch)
    tokens = mx.array([[(7 * i) % 97 + 3 for i in range(base.LAYER_QUEUE_ROWS)]])
    whole_cache = model.make_cache(1)
    whole = model(tokens, whole_cache)
    mx.eval(whole, *whole_cache.state_arrays())

    sent: list[mx.array] = []
    real_async_eval = mx.async_eval
    monkeypatch.setattr(base, "_on_gpu", lambda: True)
    monkeypatch.setattr(base.mx, "async_eval", lambda *a: (sent.append(a[0]), real_async_eval(*a))[1])
    layered_cache = model.make_cache(1)
    layered = model(tokens, layered_cache)
    mx.eval(layered, *layered_cache.state_arrays())

    assert len(sent) == len(model.layers)
    assert mx.array_equal(layered, whole).item()
    for got, want in zip(layered_cache.state_arrays(), whole_cache.state_arrays(), strict=True):
        assert mx.array_equal(got, want).item()

    sent.clear()
    mx.eval(model(tokens[:, :8], model.make_cache(1)))  # a verify-sized forward stays one graph
    assert sent == []
