"""tools/train_block_drafter.py trains through the engine's own drafting path: its batched block
logits equal `DFlashDrafter`'s for the same answer so far, its context holds the tokens before the
block (the prompt's, as the engine's prefill hands them over, and the answer's), each slot's teacher is the target's own distribution there, its
NumPy products (tools/host_products.py) give MLX's values and gradients, and a few steps halve the KL
to the target on a fixed batch."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
import train_block_drafter as tbd
from host_products import HostLinear, host_head, host_linear, host_linears
from mlx.utils import tree_flatten

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
    final = target.final_norm(out.hidden)[0]
    example = dict(
        ids=ids, start=start, taps=np.array(taps.astype(mx.float16)), final=np.array(final.astype(mx.float16))
    )
    return example, out.taps


def _config(target) -> dict:
    args = target.args
    return dict(num_hidden_layers=len(target.layers), hidden_size=args.hidden_size, pad_token_id=0)


@pytest.mark.parametrize("offset", [0, 5])
def test_training_logits_are_the_engines_drafting_logits(target, offset: int) -> None:
    drafter = _drafter(_config(target))
    example, taps = _example(target, drafter)
    context, first, labels, teacher = tbd.batch_at([example], offset, K)
    t = example["start"] + offset
    assert context.shape[1] == t and labels.shape == (1, K)  # the prompt is in the context too
    assert first.item() == example["ids"][t] and labels[0].tolist() == example["ids"][t + 1 : t + 1 + K]
    # slot j's teacher is the target's distribution of the label: its logits at the token before it
    expected = target.logits(target.forward(mx.array([example["ids"]])).hidden)[0, t : t + K]
    assert mx.allclose(target.head()(teacher[0]), expected.astype(mx.float32), atol=2e-2).item()
    trained = tbd.block_logits(drafter, target, context, first, K)[0]

    engine = DFlashDrafter(drafter, target)
    # the prompt's positions as the prefill hands them over, then the answer's committed ones
    # before the block as verify steps fold them in
    for a, b in [(0, example["start"]), (example["start"], t)]:
        if b > a:
            rows = {i: taps[i][0, a:b].astype(mx.float16).astype(mx.float32) for i in taps}
            engine.after_verify(None, example["ids"][a + 1 : b + 1], rows)
    served = engine._block_logits(example["ids"][: t + 1], K)
    assert mx.allclose(trained, served, atol=1e-4).item()


def test_host_products_give_mlxs_values_and_gradients() -> None:
    x, weight = mx.random.normal((3, 5, 8)), mx.random.normal((6, 8))
    ours = mx.grad(lambda a, w: (host_linear(a, w) ** 2).sum(), argnums=(0, 1))(x, weight)
    mlxs = mx.grad(lambda a, w: ((a @ w.T) ** 2).sum(), argnums=(0, 1))(x, weight)
    assert mx.allclose(host_linear(x, weight), x @ weight.T, atol=1e-5).item()
    assert all(mx.allclose(a, b, atol=1e-4).item() for a, b in zip(ours, mlxs, strict=True))


def test_training_on_host_products_is_training_on_mlxs(target) -> None:
    drafter, host = _drafter(_config(target)), _drafter(_config(target))
    assert host_linears(host) == 8 and isinstance(host.layers[0].self_attn.q_proj, HostLinear)
    example, _ = _example(target, drafter)
    batch = tbd.batch_at([example, example], 3, K)
    weights = mx.ones((K,))
    head = host_head(target)
    results = [
        nn.value_and_grad(m, lambda m, b: tbd.block_loss(m, target, head, b, weights))(m, batch)
        for m in (drafter, host)
    ]
    (loss, grads), (host_loss, host_grads) = results
    assert abs(loss.item() - host_loss.item()) < 1e-4
    flat, host_flat = dict(tree_flatten(grads)), dict(tree_flatten(host_grads))
    assert flat.keys() == host_flat.keys()
    assert all(mx.allclose(flat[n], host_flat[n], atol=1e-4).item() for n in flat)


def test_a_few_steps_halve_the_kl_to_the_target(target) -> None:
    drafter = _drafter(_config(target))
    host_linears(drafter)
    example, _ = _example(target, drafter)
    batch = tbd.batch_at([example, example], 3, K)
    weights = mx.exp(-mx.arange(K, dtype=mx.float32) / 4.0)
    head = host_head(target)
    step = nn.value_and_grad(drafter, lambda m, b: tbd.block_loss(m, target, head, b, weights))
    optimizer = optim.Adam(learning_rate=1e-2)
    first, _ = step(drafter, batch)
    for _ in range(10):
        loss, grads = step(drafter, batch)
        optimizer.update(drafter, grads)
        mx.eval(drafter.parameters(), optimizer.state)
    teacher = mx.softmax(head(batch[3]), axis=-1)
    entropy = (-(teacher * mx.log(teacher)).sum(axis=-1) * weights).sum(axis=1).mean() / weights.sum()
    assert loss.item() - entropy.item() < 0.5 * (first.item() - entropy.item())  # the KL to the target halves


def test_the_saved_config_reads_as_a_dflash_drafter(target) -> None:
    config = tbd.drafter_config(_config(target), type("A", (), {"layers": 2, "block_size": 8})())
    parsed = DFlashConfig.from_dict(json.loads(json.dumps(config)))
    assert parsed.num_hidden_layers == 2 and parsed.block_size == 8
    assert all(0 <= i < len(target.layers) for i in parsed.target_layer_ids)
