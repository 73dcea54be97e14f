"""A small model of the same tokenizer as drafter (e.g. `--draft 4b` for 27b).

Each sequence gets its own batch-1 cache of the draft model. Drafting feeds the newly committed
tokens in one forward, then k-1 single tokens; the cache is then restored to the committed point
(checkpoints are references, so this costs nothing), and the next call feeds what was accepted.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from kapitsa.engine.speculative.drafter import Draft, new_tokens
from kapitsa.engine.speculative.tree import TREE_TOP_K, DraftTree, build_best_first, top_candidates


class DraftModelDrafter:
    name = "draft"

    def __init__(self, model) -> None:  # noqa: ANN001 - any kapitsa HybridLM
        self.model = model
        self.cache = model.make_cache(1)
        self.fed: list[int] = []  # tokens folded into self.cache

    def observe(self, new_tokens: Sequence[int]) -> None:
        """Nothing to do eagerly: `propose` catches up on whatever was committed."""

    def _catch_up(self, context: Sequence[int]) -> mx.array:
        tail = new_tokens(context, self.fed)
        if not tail:  # not an extension, or nothing new to take logits from: start over
            self.cache, self.fed = self.model.make_cache(1), []
            tail = list(context)
        logits = self.model(mx.array([tail], dtype=mx.int32), self.cache)[0, -1]
        self.fed.extend(tail)
        return logits

    def _greedy_chain(self, first: int, length: int) -> list[int]:
        """`first`, then the draft model's greedy continuation, `length` tokens in all; the cache
        is left at the committed point."""
        committed = self.cache.checkpoint()
        tokens = [first]
        while len(tokens) < length:
            logits = self.model(mx.array([[tokens[-1]]], dtype=mx.int32), self.cache)[0, -1]
            tokens.append(int(mx.argmax(logits).item()))
        self.cache.restore(committed)
        return tokens

    def propose(self, context: Sequence[int], max_tokens: int) -> Draft:
        if max_tokens <= 0 or not context:
            return Draft(())
        logits = self._catch_up(context)
        return Draft(tuple(self._greedy_chain(int(mx.argmax(logits).item()), max_tokens)))

    def propose_tree(self, context: Sequence[int], budget: int, *, top_k: int = TREE_TOP_K) -> DraftTree:
        """A best-first tree (KFlash / EAGLE-2): the draft model's `top_k` candidates after each
        node, grown from the node of highest summed log-probability until `budget` draft nodes.
        Each expanded node costs one single-token draft forward from its parent's cache state
        (checkpoints are references, so keeping one per node is free); the cache ends at the
        committed point."""
        if budget <= 0 or not context:
            return DraftTree.chain(int(context[-1]) if context else 0, ())
        root_logits = self._catch_up(context)
        committed = self.cache.checkpoint()
        states = {(): (committed, root_logits)}

        def expand(path: tuple[int, ...]) -> list[tuple[int, float]]:
            if path not in states:
                self.cache.restore(states[path[:-1]][0])
                logits = self.model(mx.array([[path[-1]]], dtype=mx.int32), self.cache)[0, -1]
                states[path] = (self.cache.checkpoint(), logits)
            return top_candidates(states[path][1], top_k)

        tree = build_best_first(int(context[-1]), expand, budget=budget, top_k=top_k)
        self.cache.restore(committed)
        return tree
