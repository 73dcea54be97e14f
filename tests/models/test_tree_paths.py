"""The path-batched tree recurrence (ops/tree.py `tree_paths`) against the node-by-node reference
(`tree_recurrence`, the mixers' `node_walk=True`): same outputs at every real node, same replay
of an accepted path, for the Gated DeltaNet (fused chain kernel and op route) and Mamba-2 mixers."""

from __future__ import annotations

import mlx.core as mx
import pytest

from kapitsa.engine.cache.layers import RecurrentCache, StepInfo
from kapitsa.engine.models.gated_deltanet import GatedDeltaNet
from kapitsa.engine.models.mamba2 import Mamba2Mixer
from kapitsa.engine.ops.tree import gather_time, leaf_paths, tree_paths, validate_parents
from kapitsa.engine.options import KernelOptions
from tests.models.builders import build_ours

BRANCHY = [
    -1,
    0,
    1,
    2,
    1,
    4,
    5,
    0,
    7,
    8,
    9,
    8,
    0,
]  # 0 -> {1 -> {2 -> 3, 4 -> 5 -> 6}, 7 -> 8 -> {9 -> 10, 11}, 12}


def _padded(trees: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Trees padded to one width as the speculative decoder pads them (children of the root)."""
    width = max(map(len, trees))
    return [t + [0] * (width - len(t)) for t in trees], [len(t) for t in trees]


TREES = {
    "chain": ([[-1, 0, 1, 2, 3]], [5]),
    "wide_root": ([[-1] + [0] * 7], [8]),
    "deep_branchy": ([BRANCHY], [len(BRANCHY)]),
    "one_node": ([[-1]], [1]),
    "batch_padded": _padded([[-1, 0, 1, 0, 3, 1, 5], [-1, 0, 0, 2], [-1, 0, 1, 2, 3, 4, 5]]),
}


def test_leaf_paths_skip_padding_and_slots_find_every_node():
    assert leaf_paths(BRANCHY, len(BRANCHY)) == [
        [0, 1, 2, 3],
        [0, 1, 4, 5, 6],
        [0, 7, 8, 9, 10],
        [0, 7, 8, 11],
        [0, 12],
    ]
    assert leaf_paths([-1, 0, 1, 0, 0], 3) == [[0, 1, 2]]  # nodes 3, 4 are padding
    parents, lengths = TREES["batch_padded"]
    paths = tree_paths(parents, lengths)
    assert (paths.paths, paths.depth) == (3, 7)
    steps = gather_time(paths.order, paths.slots).tolist()  # the node each slot holds
    for row, n in zip(steps, lengths, strict=True):
        assert row[:n] == list(range(n))
    assert tree_paths([[-1, 0, 1]], [3]).mask is None  # a chain has no padded step
    empty = tree_paths([[-1, 0], [-1, 0]], [2, 0])  # a row that verifies nothing
    assert empty.mask.tolist() == [[True, True], [False, False]]


def _gdn(families: frozenset[str] | None) -> GatedDeltaNet:
    model = build_ours("qwen3_5_dense")
    mixer = next(layer.linear_attn for layer in model.layers if layer.is_linear)
    mixer.kernel_options = KernelOptions(families=families)
    return mixer


def _mamba() -> Mamba2Mixer:
    model = build_ours("nemotron_latent")
    return next(layer.mixer for layer in model.layers if layer.block_type == "M")


MIXERS = {
    "gdn_fused": lambda: _gdn(None),  # the backend's default families: the fused chain kernel route
    "gdn_ops": lambda: _gdn(frozenset()),
    "mamba2": _mamba,
}


def _cache(mixer, batch: int) -> RecurrentCache:
    """A cache part-way into a sequence (random conv rows and state), so s0 matters per path."""
    if isinstance(mixer, GatedDeltaNet):
        state_shape = (mixer.nv, mixer.dv, mixer.dk)
    else:
        state_shape = (mixer.heads, mixer.head_dim, mixer.state_size)
    conv_shape = (mixer.kernel - 1, mixer.conv_dim)
    conv = mx.random.normal((batch, *conv_shape), key=mx.random.key(1))
    state = 0.1 * mx.random.normal((batch, *state_shape), key=mx.random.key(2))
    return RecurrentCache(conv_shape, state_shape, conv, state)


def _deepest_paths(parents: list[list[int]], lengths: list[int]) -> tuple[mx.array, mx.array]:
    """commit_path's (mask, order) for each row's longest root-to-leaf path."""
    rows = [max(leaf_paths(p, n), key=len) for p, n in zip(parents, lengths, strict=True)]
    P = max(map(len, rows))
    order = mx.array([p + [p[-1]] * (P - len(p)) for p in rows], dtype=mx.int32)
    return mx.arange(P)[None, :] < mx.array([len(p) for p in rows])[:, None], order


@pytest.mark.parametrize("mixer_name", sorted(MIXERS))
@pytest.mark.parametrize("tree_name", sorted(TREES))
def test_path_batched_tree_equals_node_walk(mixer_name, tree_name):
    mixer = MIXERS[mixer_name]()
    parents, lengths = TREES[tree_name]
    B, T = len(parents), len(parents[0])
    info = StepInfo(T, lengths, [0] * B, record=True, parents=validate_parents(parents, B, T))
    x = mx.random.normal((B, T, mixer.out_proj.weight.shape[0]), key=mx.random.key(3))
    cache = _cache(mixer, B)
    got = mixer(x, info, cache)
    got_replay = cache.record.replay(*_deepest_paths(parents, lengths))
    want = mixer(x, info, cache, node_walk=True)
    want_replay = cache.record.replay(*_deepest_paths(parents, lengths))
    for b, n in enumerate(lengths):  # nodes past a row's length are padding: their outputs are unused
        assert mx.abs(got[b, :n] - want[b, :n]).max().item() < 1e-5, (b, n)
    assert mx.abs(got_replay - want_replay).max().item() < 1e-5
