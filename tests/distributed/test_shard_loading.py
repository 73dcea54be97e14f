"""Each rank's part of the checkpoint, in one process (no group needed): which tensors a rank
keeps, that only those are read, and the clear refusals of splits that do not divide."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytest.importorskip("mlx.core")

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from kapitsa.engine.distributed.group import Group  # noqa: E402
from kapitsa.engine.distributed.loading import load_shard  # noqa: E402
from kapitsa.engine.distributed.shard import layer_range  # noqa: E402
from kapitsa.engine.distributed.watchdog import StepClock, Watchdog  # noqa: E402
from kapitsa.errors import UnsupportedModel  # noqa: E402


def rank(r: int, size: int) -> Group:
    return Group(r, size, handle=None)  # loading touches no collective


def names(model) -> set[str]:  # noqa: ANN001
    return {name for name, _ in tree_flatten(model.parameters())}


def test_layer_ranges_cover_every_layer_once_in_order() -> None:
    for layers in (4, 5, 7, 48):
        for size in (1, 2, 3, 4):
            ranges = [layer_range(layers, r, size) for r in range(size)]
            assert [i for r in ranges for i in r] == list(range(layers))
            assert max(map(len, ranges)) - min(map(len, ranges)) <= 1


@pytest.mark.parametrize("kind", ["qwen3_5_moe", "nemotron_h", "flint"])
def test_a_pipeline_rank_keeps_only_its_layers_and_rank_0_the_ends(kind: str, checkpoints) -> None:
    first = load_shard(str(checkpoints[kind]), group=rank(0, 2), parallel="pipeline")
    second = load_shard(str(checkpoints[kind]), group=rank(1, 2), parallel="pipeline")
    assert (first.layer_ids, second.layer_ids) == ([0, 1], [2, 3])
    layer_of = lambda name: int(name.split("layers.")[1].split(".")[0])  # noqa: E731
    assert {layer_of(n) for n in names(second.model) if "layers." in n} == {2, 3}
    assert all("layers." in n for n in names(second.model))  # no embedding, final norm or head
    assert {layer_of(n) for n in names(first.model) if "layers." in n} == {0, 1}
    assert any("embed" in n for n in names(first.model)) and first.tokenizer is not None
    assert second.tokenizer is None and second.info is None


@pytest.mark.parametrize("parallel", ["pipeline", "tensor"])
def test_a_rank_holds_only_its_part_while_loading(parallel: str, checkpoints) -> None:
    """Rank 1's load peaks at its own bytes: pipeline reads only its layers; tensor parallel reads
    a layer's whole tensors to slice them, one layer at a time, and keeps copies of its slices."""
    full = load_shard(str(checkpoints["qwen3_5_moe"]), group=rank(0, 1), parallel=parallel).model
    whole = sum(v.nbytes for _, v in tree_flatten(full.parameters()))
    one_layer = max(sum(v.nbytes for _, v in tree_flatten(layer.parameters())) for layer in full.layers)
    del full
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    part = load_shard(str(checkpoints["qwen3_5_moe"]), group=rank(1, 2), parallel=parallel)
    kept = sum(v.nbytes for _, v in tree_flatten(part.model.parameters()))
    mx.eval(part.model.parameters())
    assert kept < whole * (0.5 if parallel == "pipeline" else 0.7)
    transient = 0 if parallel == "pipeline" else one_layer
    assert mx.get_peak_memory() - before <= kept * 1.1 + transient


def test_tensor_ranks_hold_a_slice_of_every_layer(checkpoints) -> None:
    whole = load_shard(str(checkpoints["nemotron_h"]), group=rank(0, 1), parallel="tensor").model
    half = load_shard(str(checkpoints["nemotron_h"]), group=rank(1, 2), parallel="tensor").model
    mamba, attn = half.layers[0].mixer, half.layers[3].mixer
    assert (mamba.heads, mamba.groups) == (
        whole.layers[0].mixer.heads // 2,
        whole.layers[0].mixer.groups // 2,
    )
    assert (attn.heads, attn.kv_heads) == (2, 1)
    assert half.layers[1].mixer.block.switch_mlp.count == 4  # 8 routed experts, 4 per rank
    assert half.args.num_key_value_heads == 1  # the KV caches are per-rank slices


@pytest.mark.parametrize(
    ("kind", "overrides", "message"),
    [
        ("nemotron_h", {"n_groups": 2}, "2 Mamba-2 groups"),
        ("nemotron_h", {"n_groups": 4, "n_routed_experts": 6}, "6 routed experts"),
        ("qwen3_next", {}, "2 linear-attention key heads"),
        ("qwen3_5", {"num_attention_heads": 2}, "2 attention heads"),
    ],
)
def test_tensor_splits_that_do_not_divide_are_refused(
    tmp_path: Path, kind: str, overrides: dict, message: str
) -> None:
    from kapitsa.testing.tiny import write_tiny_checkpoint

    folder = write_tiny_checkpoint(tmp_path / "m", kind, **overrides)
    with pytest.raises(UnsupportedModel, match=message):
        load_shard(str(folder), group=rank(0, 4), parallel="tensor")


def test_the_watchdog_fires_once_a_section_outlives_its_deadline() -> None:
    fired: list[str] = []
    dog = Watchdog(fired.append)
    dog.arm("a quick step", 1.0)
    dog.disarm()
    time.sleep(1.3)
    assert fired == []
    dog.arm("a stuck collective", 0.3)
    deadline = time.monotonic() + 10.0
    while not fired and time.monotonic() < deadline:
        time.sleep(0.02)
    assert fired == ["a stuck collective, 0 s"]


def test_a_step_may_take_a_multiple_of_its_recent_peers() -> None:
    clock = StepClock(first_s=60, floor_s=3, factor=20)
    assert clock.deadline(1) == clock.deadline(512) == 60  # nothing measured yet: warm-up
    clock.record(1, 0.01)
    clock.record(512, 2.56)  # 5 ms per token
    assert clock.deadline(1) == 3  # 20 x 10 ms is under the floor
    assert clock.deadline(512) == pytest.approx(20 * 0.005 * 512)
    clock.record(1, 0.5)
    clock.record(1, 0.5)
    assert clock.deadline(1) == 10  # the median recent decode step sets it
