"""Draft trees: nodes in DFS preorder (parent[t] < t, subtrees contiguous), the attention mask of
ancestors, and building trees: best-first from a drafter's candidates, or the trie of paths
(hybrid-engine.md §5.5). The engine's walk of a verified tree is acceptance.accept_tree."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np


@dataclass(slots=True, frozen=True)
class DraftTree:
    """Node 0 is the root: the last committed token. Every other node is a draft token."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]  # parents[0] == -1

    def __post_init__(self) -> None:
        if not self.tokens or self.parents[0] != -1 or len(self.tokens) != len(self.parents):
            raise ValueError("a draft tree needs a root with parent -1 and one parent per node")
        if any(not 0 <= p < i for i, p in enumerate(self.parents) if i):
            raise ValueError("nodes must be in preorder: parent[t] < t")

    def __len__(self) -> int:
        return len(self.tokens)

    def depths(self) -> list[int]:
        out = [0] * len(self)
        for i in range(1, len(self)):
            out[i] = out[self.parents[i]] + 1
        return out

    def children(self, node: int) -> list[int]:
        return [i for i in range(node + 1, len(self)) if self.parents[i] == node]

    def ancestor_mask(self) -> np.ndarray:
        """[T, T] bool: row t may attend to column j iff j is t or an ancestor of t."""
        mask = np.eye(len(self), dtype=bool)
        for i in range(1, len(self)):
            mask[i] |= mask[self.parents[i]]
        return mask

    def path_to(self, node: int) -> list[int]:
        path = []
        while node != -1:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    @staticmethod
    def chain(root: int, tokens: Sequence[int]) -> DraftTree:
        return DraftTree((root, *map(int, tokens)), tuple(range(-1, len(tokens))))


Expand = Callable[[tuple[int, ...]], Sequence[tuple[int, float]]]

# Candidates per node of a best-first tree: past the third, a drafter's candidates rarely carry
# enough probability to earn one of the budget's nodes.
TREE_TOP_K = 3


def top_candidates(logits: mx.array, top_k: int) -> list[tuple[int, float]]:
    """(token, log-probability) of the `top_k` likeliest tokens of one logits row, best first."""
    logprobs = logits.astype(mx.float32) - mx.logsumexp(logits.astype(mx.float32))
    top = mx.argsort(-logprobs)[:top_k]
    return list(zip(top.tolist(), logprobs[top].tolist(), strict=True))


def build_best_first(root: int, expand: Expand, *, budget: int, top_k: int = 4) -> DraftTree:
    """EAGLE-2-style: grow the nodes with the best summed log-prob until `budget` draft nodes.

    `expand(path_tokens)` returns (token, logprob) candidates after that path (root excluded).
    """
    entries: list[tuple[float, int, tuple[int, ...], int]] = []  # (-score, tiebreak, path, parent)
    counter = 0
    for token, lp in list(expand(()))[:top_k]:
        heapq.heappush(entries, (-lp, counter, (int(token),), 0))
        counter += 1
    chosen: list[tuple[tuple[int, ...], float]] = []
    while entries and len(chosen) < budget:
        neg, _, path, _ = heapq.heappop(entries)
        chosen.append((path, -neg))
        for token, lp in list(expand(path))[:top_k]:
            heapq.heappush(entries, (neg - lp, counter, (*path, int(token)), 0))
            counter += 1
    return _tree_from_paths(root, [p for p, _ in chosen])


def _tree_from_paths(root: int, paths: list[tuple[int, ...]]) -> DraftTree:
    return tree_from_paths(root, paths)


def tree_from_paths(root: int, paths: Sequence[Sequence[int]], *, budget: int | None = None) -> DraftTree:
    """The trie of `paths` under `root`, in preorder; with `budget`, earlier paths keep their nodes
    first and later ones are cut once `budget` draft nodes are used."""
    kept: set[tuple[int, ...]] = set()
    for path in paths:
        for depth in range(1, len(path) + 1):
            prefix = tuple(path[:depth])
            if prefix not in kept and (budget is None or len(kept) < budget):
                kept.add(prefix)
    # Preorder by sorting prefixes lexicographically keeps every subtree contiguous.
    index: dict[tuple[int, ...], int] = {(): 0}
    tokens, parents = [root], [-1]
    for prefix in sorted(kept):
        if prefix[:-1] in index:
            index[prefix] = len(tokens)
            tokens.append(prefix[-1])
            parents.append(index[prefix[:-1]])
    return DraftTree(tuple(tokens), tuple(parents))
