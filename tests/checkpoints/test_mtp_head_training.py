"""tools/train_mtp_head.py: the head it writes is the head the loader attaches (NVIDIA's tensor
names, one tensor per expert), its NumPy LM head is the target's, and a few steps halve the
head's KL to the target on a fixed batch."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
import train_mtp_head as tmh
from mlx.utils import tree_map

from kapitsa.engine.loading.loader import load_model
from kapitsa.testing.tiny import write_tiny_checkpoint
from tests.checkpoints.conftest import safetensors_header


@pytest.fixture
def folder(tmp_path):
    return write_tiny_checkpoint(
        tmp_path / "n", "nemotron_h", mtp_layers_block_type=["full_attention", "moe"]
    )


def _batch(model) -> tuple[mx.array, mx.array]:
    """(hidden rows [1, 17, H], next ids [1, 16]) of one random sequence."""
    ids = [int(i) for i in np.random.default_rng(0).integers(5, 200, size=24)]
    hidden = model.final_norm(model.forward(mx.array([ids])).hidden)[0]
    example = dict(ids=ids, start=8, hidden=np.array(hidden.astype(mx.float16)))
    rows, next_ids = tmh.window(example, 0, 16)
    return mx.array(rows)[None].astype(mx.float32), mx.array(next_ids)[None]


def test_the_written_head_is_the_head_the_loader_attaches(folder) -> None:
    model = load_model(folder).model
    assert model.mtp is None  # the config names the step; no tensors yet
    tmh.attach_head(model, seed=1)
    model.mtp.update(tree_map(lambda v: v.astype(mx.bfloat16).astype(mx.float32), model.mtp.parameters()))
    hidden, next_ids = _batch(model)
    ours = model.mtp_forward(next_ids, hidden[:, :-1])
    mx.save_safetensors(str(folder / tmh.MTP_FILE), tmh.published(model.mtp, model.args.n_routed_experts))

    names = safetensors_header(folder / tmh.MTP_FILE)
    assert "mtp.layers.1.mixer.experts.0.up_proj.weight" in names
    assert not any(".block." in n or "switch_mlp" in n for n in names)
    loaded = load_model(folder).model
    assert loaded.mtp is not None
    theirs = loaded.mtp_forward(next_ids, hidden[:, :-1]).astype(mx.float32)
    assert mx.allclose(theirs, ours, atol=2e-2, rtol=2e-2).item()


def test_the_numpy_head_is_the_targets_head(folder) -> None:
    model = load_model(folder).model
    x = mx.random.normal((3, 5, model.args.hidden_size))
    assert mx.allclose(tmh.host_head(model)(x), model.head()(x).astype(mx.float32), atol=1e-4).item()


def test_a_few_steps_halve_the_kl_to_the_target(folder) -> None:
    model = load_model(folder).model
    tmh.attach_head(model, seed=1)
    batch = _batch(model)
    head = tmh.host_head(model)
    step = nn.value_and_grad(model, lambda m, h, i: tmh.distill_loss(m, head, h, i))
    optimizer = optim.Adam(learning_rate=1e-2)
    first, _ = step(model, *batch)
    for _ in range(10):
        loss, grads = step(model, *batch)
        optimizer.update(model, grads)
        mx.eval(model.mtp.parameters(), optimizer.state)
    teacher = mx.softmax(head(batch[0][:, 1:]), axis=-1)
    entropy = -(teacher * mx.log(teacher)).sum(axis=-1).mean().item()  # the loss's floor (KL = 0)
    assert loss.item() - entropy < 0.5 * (first.item() - entropy)
