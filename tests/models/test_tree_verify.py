"""Draft-tree verification: each node's logits equal its root path run as a chain; committing a
path leaves the cache as if exactly that path had been decoded."""

from __future__ import annotations

import mlx.core as mx
import pytest

from tests.models.builders import build_ours

PROMPT = [11, 23, 5, 99, 140, 7, 64, 3]
TOKENS = [42, 17, 250, 8, 130, 77, 5]
PARENTS = [-1, 0, 1, 0, 3, 1, 5]  # preorder: 0 -> {1 -> {2, 5 -> 6}, 3 -> 4}


def _path(parents, node):
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


def _chain_logits(model, prompt, tokens):
    cache = model.make_cache()
    model(mx.array([prompt]), cache)
    return model(mx.array([tokens]), cache)[0, -1], cache


@pytest.mark.parametrize("arch", ["qwen3_5_dense", "qwen3_next", "nemotron_latent"])
def test_tree_node_logits_equal_their_chains_and_commit(arch):
    model = build_ours(arch)
    cache = model.make_cache()
    model(mx.array([PROMPT]), cache)
    logits = model(mx.array([TOKENS]), cache, parents=[PARENTS])[0]
    assert cache.offsets == [len(PROMPT)]  # nothing held before commit_path
    for node in range(len(TOKENS)):
        want, _ = _chain_logits(model, PROMPT, [TOKENS[i] for i in _path(PARENTS, node)])
        assert mx.abs(logits[node] - want).max().item() < 1e-4, node
    path = _path(PARENTS, 6)  # [0, 1, 5, 6]: not contiguous in the node order
    cache.commit_path([path])
    assert cache.offsets == [len(PROMPT) + len(path)]
    got = model(mx.array([[9]]), cache)[0, -1]
    _, plain = _chain_logits(model, PROMPT, [TOKENS[i] for i in path])
    assert mx.abs(got - model(mx.array([[9]]), plain)[0, -1]).max().item() < 1e-4


def test_batched_trees_with_different_shapes_and_paths():
    model = build_ours("nemotron_moe")
    prompts = [PROMPT, PROMPT[:5]]
    cache = model.make_cache(2)
    model(mx.array([prompts[0], prompts[1] + [0, 0, 0]]), cache, lengths=[8, 5])
    parents = [PARENTS, [-1, 0, 0, 2, 3, 0, 5]]
    trees = [TOKENS, TOKENS[::-1]]
    logits = model(mx.array(trees), cache, parents=parents)
    for b in range(2):
        for node in (2, 4, 6):
            want, _ = _chain_logits(model, prompts[b], [trees[b][i] for i in _path(parents[b], node)])
            assert mx.abs(logits[b, node] - want).max().item() < 1e-4
    paths = [_path(parents[0], 4), []]  # row 1 keeps nothing
    cache.commit_path(paths)
    assert cache.offsets == [8 + 3, 5]
    got = model(mx.array([[9], [9]]), cache)[:, -1]
    for b in range(2):
        plain = model.make_cache()
        model(mx.array([prompts[b] + [trees[b][i] for i in paths[b]]]), plain)
        assert mx.abs(got[b] - model(mx.array([[9]]), plain)[0, -1]).max().item() < 1e-4


def test_tree_misuse_is_rejected():
    model = build_ours("qwen3_5_dense")
    cache = model.make_cache()
    model(mx.array([PROMPT]), cache)
    with pytest.raises(ValueError):
        model(mx.array([TOKENS[:3]]), cache, parents=[[-1, 2, 0]])  # not preorder
    model(mx.array([TOKENS]), cache, parents=[PARENTS])
    with pytest.raises(ValueError):
        cache.rollback(2)  # trees are resolved with commit_path
    with pytest.raises(ValueError):
        cache.commit_path([[0, 2]])  # 2 is not a child of 0
    with pytest.raises(ValueError):
        model(mx.array([TOKENS]), None, parents=[PARENTS])
