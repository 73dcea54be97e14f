"""Prompt-lookup drafting: find the latest earlier occurrence of the current suffix and copy what
followed it. No model, and very strong for agents that rewrite code they just read."""

from __future__ import annotations

from collections.abc import Sequence

from kapitsa.engine.speculative.drafter import Draft, new_tokens
from kapitsa.engine.speculative.tree import DraftTree, tree_from_paths


class NGramDrafter:
    """Matches the longest suffix (between `min_n` and `max_n` tokens) seen earlier in the context.

    An index from each n-gram to its latest end position is updated incrementally, so a proposal
    costs O(max_n) lookups, not a scan of the context.
    """

    name = "ngram"
    extends_free = True  # a longer proposal costs nothing: the decoder fills padding with it
    drafts_on_host = True  # no device work: its guesses are scored while speculation rests (shadow.py)

    def __init__(self, *, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        self.min_n, self.max_n = min_n, max_n
        self._tokens: list[int] = []
        # n-gram -> positions just after each of its occurrences, oldest first
        self._ends: dict[tuple[int, ...], list[int]] = {}
        self._suffix: list[list[int]] = []  # the lists of the context's last n-grams, longest first

    def reset(self, context: Sequence[int]) -> None:
        self._tokens = []
        self._ends.clear()
        self._suffix = []
        self.observe(context)

    def observe(self, new_tokens: Sequence[int]) -> None:
        tokens, ends_of = self._tokens, self._ends
        for token in new_tokens:
            tokens.append(int(token))
            end = len(tokens)
            # the suffix's own lists, longest n first: _earlier_matches reads them without
            # building the keys again (it runs every decode step, also while speculation rests)
            self._suffix = [
                ends_of.setdefault(tuple(tokens[end - n : end]), [])
                for n in range(min(self.max_n, end), self.min_n - 1, -1)
            ]
            for ends in self._suffix:
                ends.append(end)

    def _sync(self, context: Sequence[int]) -> None:
        tail = new_tokens(context, self._tokens)
        if tail is None:
            self.reset(context)
        elif tail:
            self.observe(tail)

    def _earlier_matches(self, limit: int) -> list[int]:
        """Start positions of what followed the latest `limit` earlier occurrences of the longest
        matching suffix, latest first (the suffix's own occurrence, each list's last entry,
        excluded). Reads only the list's tail: a common n-gram's list grows with the context."""
        for ends in self._suffix:
            if len(ends) > 1:
                return ends[-2 : -2 - limit : -1]
        return []

    def propose(self, context: Sequence[int], max_tokens: int) -> Draft:
        self._sync(context)
        starts = self._earlier_matches(1)
        if max_tokens <= 0 or not starts:
            return Draft(())
        return Draft(tuple(self._tokens[starts[0] : starts[0] + max_tokens]))

    def propose_tree(self, context: Sequence[int], budget: int, *, branches: int = 3) -> DraftTree:
        """A trie of what followed the latest `branches` earlier matches, `budget` draft nodes at most."""
        self._sync(context)
        paths: list[tuple[int, ...]] = []
        for start in self._earlier_matches(4 * branches):
            path = tuple(self._tokens[start : start + budget])
            if path and all(p[: len(path)] != path for p in paths):
                paths.append(path)
            if len(paths) == branches:
                break
        return tree_from_paths(int(context[-1]), paths, budget=budget)
