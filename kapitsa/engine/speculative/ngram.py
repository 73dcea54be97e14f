"""Prompt-lookup drafting: find the latest earlier occurrence of the current suffix and copy what
followed it. No model, and very strong for agents that rewrite code they just read."""

from __future__ import annotations

from collections.abc import Sequence

from kapitsa.engine.speculative.drafter import Draft


class NGramDrafter:
    """Matches the longest suffix (between `min_n` and `max_n` tokens) seen earlier in the context.

    An index from each n-gram to its latest end position is updated incrementally, so a proposal
    costs O(max_n) lookups, not a scan of the context.
    """

    name = "ngram"

    def __init__(self, *, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        self.min_n, self.max_n = min_n, max_n
        self._tokens: list[int] = []
        # n-gram -> position just after its latest occurrence, and the one before that
        self._latest: dict[tuple[int, ...], int] = {}
        self._previous: dict[tuple[int, ...], int] = {}

    def reset(self, context: Sequence[int]) -> None:
        self._tokens = []
        self._latest.clear()
        self._previous.clear()
        self.observe(context)

    def observe(self, new_tokens: Sequence[int]) -> None:
        for token in new_tokens:
            self._tokens.append(int(token))
            end = len(self._tokens)
            for n in range(self.min_n, self.max_n + 1):
                if end >= n:
                    key = tuple(self._tokens[end - n : end])
                    if key in self._latest:
                        self._previous[key] = self._latest[key]
                    self._latest[key] = end

    def _sync(self, context: Sequence[int]) -> None:
        known = len(self._tokens)
        if known > len(context) or list(context[:known]) != self._tokens:
            self.reset(context)
        elif known < len(context):
            self.observe(context[known:])

    def propose(self, context: Sequence[int], max_tokens: int) -> Draft:
        self._sync(context)
        if max_tokens <= 0:
            return Draft(())
        end = len(self._tokens)
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            key = tuple(self._tokens[end - n :])
            # The suffix itself is the latest occurrence; copy from the one before it.
            start = self._previous.get(key) if self._latest.get(key) == end else self._latest.get(key)
            if start is not None and start < end:
                return Draft(tuple(self._tokens[start : min(start + max_tokens, end)]))
        return Draft(())
