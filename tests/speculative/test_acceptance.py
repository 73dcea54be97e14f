"""Acceptance rules: greedy is exact, sampling preserves the target distribution."""

from __future__ import annotations

import numpy as np
import pytest

from kapitsa.engine.speculative import Draft, accept_greedy, accept_sampled
from kapitsa.engine.speculative.acceptance import accept_siblings_sampled

V = 6


def _dist(rng: np.random.Generator, temperature: float = 1.0) -> np.ndarray:
    logits = rng.normal(size=V) / temperature
    p = np.exp(logits - logits.max())
    return p / p.sum()


def test_greedy_keeps_longest_matching_prefix_plus_bonus() -> None:
    assert accept_greedy([5, 7, 9], [5, 7, 1, 3]).tokens == (5, 7, 1)
    assert accept_greedy([5, 7, 9], [5, 7, 9, 3]).tokens == (5, 7, 9, 3)
    assert accept_greedy([5, 7, 9], [4, 7, 9, 3]).tokens == (4,)
    assert accept_greedy([], [2]).tokens == (2,)
    with pytest.raises(ValueError):
        accept_greedy([1, 2], [1, 2])


def _tv(counts: np.ndarray, p: np.ndarray) -> float:
    return 0.5 * float(np.abs(counts / counts.sum() - p).sum())


@pytest.mark.parametrize("with_q", [False, True])
def test_sampling_preserves_target_distribution_of_first_two_tokens(with_q: bool) -> None:
    # Target p depends on the previous token (a tiny Markov chain), so the second emitted token's
    # law is the marginal over paths: any bias in acceptance shows up as TV distance.
    rng = np.random.default_rng(0)
    trans = np.stack([_dist(rng, 0.7) for _ in range(V)])  # p(next | prev)
    q_trans = np.stack([_dist(rng, 1.5) for _ in range(V)])  # a worse drafter
    start = 2
    joint = np.zeros((V, V))
    n = 40000
    draw = np.random.default_rng(1)
    for _ in range(n):
        d0 = int(draw.choice(V, p=q_trans[start])) if with_q else int(draw.integers(V))
        d1 = int(draw.choice(V, p=q_trans[d0])) if with_q else int(draw.integers(V))
        probs = np.stack([q_trans[start], q_trans[d0]]) if with_q else None
        target = np.stack([trans[start], trans[d0], trans[d1]])
        res = accept_sampled(Draft((d0, d1), probs), target, draw)
        t0 = res.tokens[0]
        t1 = res.tokens[1] if len(res.tokens) > 1 else int(draw.choice(V, p=trans[t0]))
        joint[t0, t1] += 1
    expected = trans[start][:, None] * trans
    assert _tv(joint.ravel(), expected.ravel()) < 0.02


def test_broken_acceptance_is_detected() -> None:
    """Negative control: always accepting point-mass drafts skews the distribution far past the bound."""
    rng = np.random.default_rng(3)
    p = _dist(rng)
    counts = np.zeros(V)
    for _ in range(20000):
        counts[int(rng.integers(V))] += 1  # "accept the uniform draft" = uniform output
    assert _tv(counts, p) > 0.05


def test_sibling_decomposition_samples_exactly_p() -> None:
    rng = np.random.default_rng(5)
    p = _dist(rng)
    counts = np.zeros(V)
    for _ in range(40000):
        token, _ = accept_siblings_sampled([3, 1, 4], p, rng)
        counts[token] += 1
    assert _tv(counts, p) < 0.015
