"""The engine's own acceptance code (speculative/acceptance.py): greedy walks are exact, and under
sampling the emitted tokens follow the target's distribution, checked by chi-square over many
draws with the engine's `SequenceSampler` (temperature, top-k) doing the sampling."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from kapitsa.engine.runner.sampler import SequenceSampler
from kapitsa.engine.speculative import acceptance
from kapitsa.engine.speculative.acceptance import accept_chain, accept_tree
from kapitsa.engine.speculative.tree import DraftTree
from kapitsa.engine.types import SamplingParams

V = 6
DRAWS = 12_000


def _chain_logits(seed: int) -> np.ndarray:
    """logits[prev] of a tiny Markov chain: the target's next-token logits after token `prev`."""
    return np.random.default_rng(seed).normal(scale=1.5, size=(V, V)).astype(np.float32)


def _target(logits: np.ndarray, temperature: float, top_k: int) -> np.ndarray:
    """The target distribution, computed independently of the engine: softmax(l / T) over the top k."""
    z = logits / temperature
    if top_k:
        cut = np.sort(z, axis=-1)[..., -top_k][..., None]
        z = np.where(z >= cut, z, -np.inf)
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    return p / p.sum(axis=-1, keepdims=True)


def _chi_square_passes(counts: np.ndarray, expected_p: np.ndarray) -> tuple[float, float]:
    """(statistic, critical value at p = 1e-3), cells with expected count < 5 pooled."""
    n = counts.sum()
    expected = expected_p.ravel() * n
    observed = counts.ravel().astype(np.float64)
    small = expected < 5
    obs = np.append(observed[~small], observed[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    z = 3.09  # the normal quantile of 1 - 1e-3 (Wilson-Hilferty)
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat, critical


def _joint_of_first_two(temperature: float, top_k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Counts of (t0, t1) emitted after token 0 through `accept_chain` with a 2-token draft (drafts
    vary, from always-right to always-wrong); t1 comes from a plain step when t0 rejected d0."""
    logits = _chain_logits(seed)
    params = SamplingParams(temperature=temperature, top_k=top_k, seed=seed)
    sampler = SequenceSampler(params)
    pick = np.random.default_rng(seed + 1)
    counts = np.zeros((V, V))
    for _ in range(DRAWS):
        d0, d1 = (int(t) for t in pick.integers(V, size=2))
        rows = mx.array(logits[[0, d0, d1]])
        tokens, _ = accept_chain(sampler, [d0, d1], rows)
        t0 = tokens[0].token_id
        t1 = tokens[1].token_id if len(tokens) > 1 else sampler.sample(mx.array(logits[t0])).token_id
        counts[t0, t1] += 1
    p = _target(logits, temperature, top_k)
    return counts, p[0][:, None] * p


@pytest.mark.parametrize(("temperature", "top_k"), [(1.0, 0), (0.7, 3)])
def test_chain_acceptance_samples_the_target_distribution(temperature: float, top_k: int) -> None:
    counts, expected = _joint_of_first_two(temperature, top_k, seed=3)
    stat, critical = _chi_square_passes(counts, expected)
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}"


def test_a_biased_acceptance_fails_the_same_check(monkeypatch) -> None:  # noqa: ANN001
    """The negative control: accepting every draft token (uniform draws of 0) is caught."""
    monkeypatch.setattr(acceptance, "_uniform", lambda sampler: 0.0)
    counts, expected = _joint_of_first_two(1.0, 0, seed=3)
    stat, critical = _chi_square_passes(counts, expected)
    assert stat > 10 * critical


def test_tree_acceptance_samples_the_target_distribution() -> None:
    """Root 0 with candidate children 1, 2, 4 and a grandchild under 1: the first two emitted
    tokens follow p(t0) p(t1 | t0) whichever branch they take."""
    logits = _chain_logits(5)
    tree = DraftTree((0, 1, 3, 2, 4), (-1, 0, 1, 0, 0))
    rows = mx.array(logits[list(tree.tokens)])
    sampler = SequenceSampler(SamplingParams(temperature=0.8, seed=7))
    counts = np.zeros((V, V))
    for _ in range(DRAWS):
        tokens, path = accept_tree(sampler, tree, rows)
        assert [tree.tokens[i] for i in path[1:]] == [t.token_id for t in tokens[: len(path) - 1]]
        t0 = tokens[0].token_id
        t1 = tokens[1].token_id if len(tokens) > 1 else sampler.sample(mx.array(logits[t0])).token_id
        counts[t0, t1] += 1
    p = _target(logits, 0.8, 0)
    stat, critical = _chi_square_passes(counts, p[0][:, None] * p)
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}"


def _one_hot_rows(picks: list[int]) -> mx.array:
    rows = np.full((len(picks), V + 4), -5.0, dtype=np.float32)
    rows[np.arange(len(picks)), picks] = 5.0
    return mx.array(rows)


@pytest.mark.parametrize("plain", [True, False], ids=["bare-argmax", "processed"])
def test_greedy_chain_keeps_the_longest_matching_prefix_plus_the_targets_token(plain: bool) -> None:
    params = (
        SamplingParams(temperature=0) if plain else SamplingParams(temperature=0, repetition_penalty=1.0001)
    )

    def emitted(draft: list[int], picks: list[int]) -> tuple[list[int], int]:
        tokens, accepted = accept_chain(SequenceSampler(params), draft, _one_hot_rows(picks))
        return [t.token_id for t in tokens], accepted

    assert emitted([5, 7, 9], [5, 7, 1, 3]) == ([5, 7, 1], 2)
    assert emitted([5, 7, 9], [5, 7, 9, 3]) == ([5, 7, 9, 3], 3)
    assert emitted([5, 7, 9], [4, 7, 9, 3]) == ([4], 0)
    assert emitted([], [2]) == ([2], 0)


def test_greedy_tree_walk_follows_the_targets_picks() -> None:
    # root(10) -> a(1) -> c(3); root -> b(2)
    tree = DraftTree((10, 1, 3, 2), (-1, 0, 1, 0))
    greedy = SamplingParams(temperature=0)

    def walk(picks: list[int]) -> tuple[list[int], list[int]]:
        tokens, path = accept_tree(SequenceSampler(greedy), tree, _one_hot_rows(picks))
        return path, [t.token_id for t in tokens]

    assert walk([1, 3, 8, 0]) == ([0, 1, 2], [1, 3, 8])
    assert walk([2, 0, 0, 5]) == ([0, 3], [2, 5])
    assert walk([7, 0, 0, 0]) == ([0], [7])
