"""The engine's lossless acceptance rules (hybrid-engine.md §5.4), for chains and trees.

Greedy keeps the longest draft prefix equal to the target's own picks, plus the target's next
token. Sampling is speculative sampling for point-mass drafts (every drafter proposes its argmax
or a copied token): accept draft token d with probability p(d), else sample p with d removed; over
a tree's sibling candidates the same rule runs in turn on the renormalised residual. Either way
the emitted tokens are distributed exactly as the target's own samples
(tests/speculative/test_acceptance.py checks the distribution by chi-square).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from kapitsa.engine.runner.sampler import SampledToken, SequenceSampler, filter_logits
from kapitsa.engine.speculative.tree import DraftTree


def is_plain_greedy(sampler: SequenceSampler) -> bool:
    return sampler.is_greedy_plain and sampler.params.logprobs is None


def accept_chain(
    sampler: SequenceSampler, draft: list[int], rows: mx.array, argmax: list[int] | None = None
) -> tuple[list[SampledToken], int]:
    """The tokens to emit for one sequence and how many drafts they keep (`argmax`: the rows'
    argmax ids, already read back, for bare greedy sampling).

    Positions are taken in order so penalties and logit processors see each position's true
    prefix (the sampler observes every emitted token before the next position is processed).
    """
    if is_plain_greedy(sampler):
        return _accept_plain_greedy(sampler, draft, rows, argmax)
    out: list[SampledToken] = []
    greedy = sampler.params.temperature == 0
    for i, token in enumerate(draft):
        row = rows[i]
        if greedy:
            pick = sampler.sample(row)
            out.append(pick)
            if pick.token_id != token:
                return out, i
            continue
        probs = _target_probs(sampler, row)
        if _uniform(sampler) < probs[token]:
            out.append(sampler._finish(row, mx.array(token)))
            continue
        residual = probs.copy()
        residual[token] = 0.0  # a point-mass draft: the residual is p without d, renormalised
        out.append(sampler._finish(row, mx.array(_draw(residual, _uniform(sampler)))))
        return out, i
    out.append(sampler.sample(rows[len(draft)]))
    return out, len(draft)


def _accept_plain_greedy(
    sampler: SequenceSampler, draft: list[int], rows: mx.array, argmax: list[int] | None = None
) -> tuple[list[SampledToken], int]:
    """Bare argmax rows need no per-position processing: one read-back for the whole draft."""
    if argmax is None:
        argmax = mx.argmax(rows[: len(draft) + 1], axis=-1).tolist()
    picks = argmax[: len(draft) + 1]
    accepted = next((i for i, token in enumerate(draft) if picks[i] != token), len(draft))
    emitted = picks[: accepted + 1]
    for token in emitted:
        sampler.observe(token)
    return [SampledToken(token, 0.0) for token in emitted], accepted


def accept_tree(
    sampler: SequenceSampler, tree: DraftTree, rows: mx.array
) -> tuple[list[SampledToken], list[int]]:
    """Walk the verified tree from the root: greedy follows the child equal to the target's pick;
    sampling accepts sibling candidates by the sequential residual rule, which samples exactly
    from the target. Returns the emitted tokens and the kept root path (node indices)."""
    node, path, out = 0, [0], []
    greedy = sampler.params.temperature == 0
    while True:
        kids = tree.children(node)
        row = rows[node]
        if greedy:
            pick = sampler.sample(row)
            out.append(pick)
            nxt = next((c for c in kids if tree.tokens[c] == pick.token_id), None)
        else:
            probs = _target_probs(sampler, row)
            nxt = None
            for c in kids:
                token = tree.tokens[c]
                if _uniform(sampler) * probs.sum() < probs[token]:
                    nxt = c
                    break
                probs[token] = 0.0
            token = tree.tokens[nxt] if nxt is not None else _draw(probs, _uniform(sampler))
            out.append(sampler._finish(row, mx.array(token)))
        if nxt is None:
            return out, path
        node = nxt
        path.append(node)


def _target_probs(sampler: SequenceSampler, row: mx.array) -> np.ndarray:
    p = sampler.params
    logits = filter_logits(sampler.process(row) / p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p)
    return np.array(mx.softmax(logits), dtype=np.float64)


def _uniform(sampler: SequenceSampler) -> float:
    return float(mx.random.uniform(key=sampler._next_key()).item())


def _draw(weights: np.ndarray, u: float) -> int:
    cdf = np.cumsum(weights)
    return int(min(np.searchsorted(cdf, u * cdf[-1], side="right"), len(weights) - 1))
