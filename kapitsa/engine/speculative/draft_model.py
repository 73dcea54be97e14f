"""A small model of the same tokenizer as drafter (e.g. `--draft 4b` for 27b).

Each sequence gets its own batch-1 cache of the draft model. Drafting feeds the newly committed
tokens in one forward, then k-1 single tokens; the cache is then restored to the committed point
(checkpoints are references, so this costs nothing), and the next call feeds what was accepted.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from kapitsa.engine.speculative.drafter import Draft


class DraftModelDrafter:
    name = "draft"

    def __init__(self, model) -> None:  # noqa: ANN001 - any kapitsa HybridLM
        self.model = model
        self.cache = model.make_cache(1)
        self.fed: list[int] = []  # tokens folded into self.cache

    def observe(self, new_tokens: Sequence[int]) -> None:
        """Nothing to do eagerly: `propose` catches up on whatever was committed."""

    def _catch_up(self, context: Sequence[int]) -> mx.array:
        known = len(self.fed)
        if known >= len(context) or list(context[:known]) != self.fed:
            self.cache, self.fed, known = self.model.make_cache(1), [], 0
        tail = list(context[known:])
        logits = self.model(mx.array([tail], dtype=mx.int32), self.cache)[0, -1]
        self.fed = list(context)
        return logits

    def propose(self, context: Sequence[int], max_tokens: int) -> Draft:
        if max_tokens <= 0 or not context:
            return Draft(())
        logits = self._catch_up(context)
        committed = self.cache.checkpoint()
        tokens = [int(mx.argmax(logits).item())]
        while len(tokens) < max_tokens:
            logits = self.model(mx.array([[tokens[-1]]], dtype=mx.int32), self.cache)[0, -1]
            tokens.append(int(mx.argmax(logits).item()))
        self.cache.restore(committed)
        return Draft(tuple(tokens))
