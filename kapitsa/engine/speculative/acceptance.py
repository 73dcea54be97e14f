"""Lossless acceptance rules (hybrid-engine.md §5.4).

Greedy keeps the longest draft prefix equal to the target's own argmax, plus the target's next
token. Sampling is standard speculative sampling: accept draft token d with probability
min(1, p(d)/q(d)), else sample from the residual norm(max(0, p - q)); a point-mass draft has
q = one-hot(d), so the rule becomes "accept with probability p(d), else sample p with d removed".
Either way the emitted tokens are distributed exactly as the target's own samples.
Inputs are host arrays: the caller moves the k+1 target rows off the device once per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kapitsa.engine.speculative.drafter import Draft


@dataclass(slots=True, frozen=True)
class AcceptResult:
    num_accepted: int  # draft tokens kept
    tokens: tuple[int, ...]  # what to commit: the kept drafts, then one token from the target


def accept_greedy(draft_tokens: Sequence[int], target_argmax: Sequence[int]) -> AcceptResult:
    """`target_argmax[i]` is the target's choice after the committed prefix plus `draft_tokens[:i]`
    (so it has len(draft_tokens) + 1 entries)."""
    if len(target_argmax) != len(draft_tokens) + 1:
        raise ValueError("target_argmax needs one entry per draft token plus one")
    n = 0
    while n < len(draft_tokens) and int(draft_tokens[n]) == int(target_argmax[n]):
        n += 1
    return AcceptResult(n, tuple(int(t) for t in draft_tokens[:n]) + (int(target_argmax[n]),))


def _sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    cdf = np.cumsum(probs, dtype=np.float64)
    u = rng.random() * cdf[-1]
    return int(min(np.searchsorted(cdf, u, side="right"), len(probs) - 1))


def _residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    res = np.maximum(p - q, 0.0)
    total = res.sum()
    # p == q exactly leaves nothing to correct; any sample from p is then right.
    return res / total if total > 0 else p


def accept_sampled(draft: Draft, target_probs: np.ndarray, rng: np.random.Generator) -> AcceptResult:
    """`target_probs` is [len(draft)+1, V]: the target's (temperature/top-p shaped) distributions."""
    k = len(draft)
    if target_probs.shape[0] != k + 1:
        raise ValueError("target_probs needs one row per draft token plus one")
    p_all = np.asarray(target_probs, dtype=np.float64)
    for i, token in enumerate(draft.tokens):
        p = p_all[i]
        if draft.probs is None:
            q = np.zeros_like(p)
            q[token] = 1.0
        else:
            q = np.asarray(draft.probs[i], dtype=np.float64)
        if q[token] <= 0 or rng.random() * q[token] >= p[token]:
            return AcceptResult(i, tuple(draft.tokens[:i]) + (_sample(_residual(p, q), rng),))
    return AcceptResult(k, tuple(draft.tokens) + (_sample(p_all[k], rng),))


def accept_siblings_sampled(
    candidates: Sequence[int], p: np.ndarray, rng: np.random.Generator
) -> tuple[int, bool]:
    """Choose among deterministic sibling drafts at one tree node, exactly distributed as p.

    Sequential decomposition: accept c_i with probability p_res(c_i), else zero it and renormalise;
    if every candidate is rejected, sample the final residual. Returns (token, was_a_candidate).
    """
    res = np.asarray(p, dtype=np.float64).copy()
    res /= res.sum()
    for token in candidates:
        if rng.random() < res[token]:
            return int(token), True
        res[token] = 0.0
        total = res.sum()
        if total <= 0:
            break
        res /= total
    return _sample(res, rng), False
