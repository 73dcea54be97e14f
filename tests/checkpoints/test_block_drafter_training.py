"""tools/train_block_drafter.py trains through the engine's own drafting path: its batched block
logits equal `DFlashDrafter`'s for the same answer so far, its context holds the answer's tokens
before the block (not the prompt), and a few steps lower the loss of a fixed batch."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
import train_block_drafter as tbd

from kapitsa.engine.loading.loader import load_model
from kapitsa.engine.speculative.dflash import DFlashConfig, DFlashDrafter, DFlashModel
from kapitsa.testing.tiny import write_tiny_checkpoint

K = 4


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_model(write_tiny_checkpoint(tmp_path_factory.mktemp("t") / "q", "qwen3_5")).model


def _drafter(target_config: dict) -> DFlashModel:
    args = type("A", (), {"layers": 1, "block_size": K + 1})()
    mx.random.seed(3)
    return DFlashModel(DFlashConfig.from_dict(tbd.drafter_config(target_config, args)))


def _example(target, drafter: DFlashModel, length: int = 40, start: int = 12) -> dict:
    ids = [int(i) for i in np.random.default_rng(0).integers(5, 400, size=length)]
    layers = drafter.config.target_layer_ids
    out = target.forward(mx.array([ids]), taps=layers)
    taps = mx.concatenate([out.taps[i] for i in layers], axis=-1)[0]
    return dict(ids=ids, start=start, taps=np.array(taps.astype(mx.float16))), out.taps


def _config(target) -> dict:
    args = target.args
    return dict(num_hidden_layers=len(target.layers), hidden_size=args.hidden_size, pad_token_id=0)


@pytest.mark.parametrize("offset", [0, 5])
def test_training_logits_are_the_engines_drafting_logits(target, offset: int) -> None:
    drafter = _drafter(_config(target))
    example, taps = _example(target, drafter)
    context, first, labels = tbd.batch_at([example], offset, K)
    assert context.shape[1] == offset and labels.shape == (1, K)
    t = example["start"] + offset
    assert first.item() == example["ids"][t] and labels[0].tolist() == example["ids"][t + 1 : t + 1 + K]
    trained = tbd.block_logits(drafter, target, context, first, K)[0]

    engine = DFlashDrafter(drafter, target)
    if offset:  # the answer's committed positions before the block, as verify steps fold them in
        rows = {i: taps[i][0, example["start"] : t].astype(mx.float16).astype(mx.float32) for i in taps}
        engine.after_verify(None, example["ids"][example["start"] : t], rows)
    served = engine._block_logits(example["ids"][: t + 1], K)
    assert mx.allclose(trained, served, atol=1e-4).item()


def test_a_few_steps_lower_the_loss(target) -> None:
    drafter = _drafter(_config(target))
    example, _ = _example(target, drafter)
    batch = tbd.batch_at([example, example], 3, K)
    weights = mx.exp(-mx.arange(K, dtype=mx.float32) / 4.0)
    step = nn.value_and_grad(drafter, lambda m, b: tbd.block_loss(m, target, b, weights))
    optimizer = optim.Adam(learning_rate=1e-2)
    first, _ = step(drafter, batch)
    for _ in range(10):
        loss, grads = step(drafter, batch)
        optimizer.update(drafter, grads)
        mx.eval(drafter.parameters(), optimizer.state)
    assert loss.item() < first.item() * 0.8


def test_the_saved_config_reads_as_a_dflash_drafter(target) -> None:
    config = tbd.drafter_config(_config(target), type("A", (), {"layers": 2, "block_size": 8})())
    parsed = DFlashConfig.from_dict(json.loads(json.dumps(config)))
    assert parsed.num_hidden_layers == 2 and parsed.block_size == 8
    assert all(0 <= i < len(target.layers) for i in parsed.target_layer_ids)
