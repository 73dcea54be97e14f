"""Prompt-lookup drafting: find the latest earlier occurrence of the current suffix and copy what
followed it. No model, and very strong for agents that rewrite code they just read."""

from __future__ import annotations

from bisect import bisect_left
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
        self._reference = Reference(ReferenceIndex(()))
        # the last proposal's tokens copied from the reference (a chain's whole draft, a tree's
        # first path): what a predicted output's usage counts
        self.drafted_from_reference: tuple[int, ...] = ()

    def add_reference(self, tokens: Sequence[int], *, like: NGramDrafter | None = None) -> None:
        """Draft also from `tokens`, text the output is expected to repeat (a predicted output).
        `like`: a drafter given the same tokens (another choice of the request), whose index is
        shared instead of built again."""
        index = like._reference.index if like is not None else None
        same = index is not None and index.tokens and index.source is tokens
        if not same or (index.min_n, index.max_n) != (self.min_n, self.max_n):
            index = ReferenceIndex(tokens, min_n=self.min_n, max_n=self.max_n)
        self._reference = Reference(index)

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
        self.drafted_from_reference = ()
        if max_tokens <= 0:
            return Draft(())
        own = self._matched_length()
        if self._reference.tokens:
            follows = self._reference.follow(self._tokens, longer_than=own - 1, limit=max_tokens)
            if follows:  # the reference wins ties: it is what the output is expected to be
                self.drafted_from_reference = follows
                return Draft(follows)
        starts = self._earlier_matches(1)
        if not starts:
            return Draft(())
        return Draft(tuple(self._tokens[starts[0] : starts[0] + max_tokens]))

    def _matched_length(self) -> int:
        """The n of the longest suffix n-gram the context saw before (0: none)."""
        end = len(self._tokens)
        for n, ends in zip(range(min(self.max_n, end), self.min_n - 1, -1), self._suffix, strict=False):
            if len(ends) > 1:
                return n
        return 0

    def propose_tree(self, context: Sequence[int], budget: int, *, branches: int = 3) -> DraftTree:
        """A trie of what followed the latest `branches` earlier matches, `budget` draft nodes at most."""
        self._sync(context)
        paths: list[tuple[int, ...]] = []
        follows = self._reference.follow(self._tokens, longer_than=self._matched_length() - 1, limit=budget)
        self.drafted_from_reference = follows  # the first path: the budget keeps all of it
        if follows:
            paths.append(follows)
        for start in self._earlier_matches(4 * branches):
            path = tuple(self._tokens[start : start + budget])
            if path and all(p[: len(path)] != path for p in paths):
                paths.append(path)
            if len(paths) == branches:
                break
        return tree_from_paths(int(context[-1]), paths, budget=budget)


class ReferenceIndex:
    """A fixed token sequence's n-grams (`min_n` to `max_n` tokens) -> the positions just after
    each occurrence, in order. Read-only once built, so the choices of a request share one."""

    def __init__(self, tokens: Sequence[int], *, min_n: int = 2, max_n: int = 4) -> None:
        self.source = tokens  # what it was built from (identity tells a sharer it is the same)
        self.tokens = tuple(int(t) for t in tokens)
        self.min_n, self.max_n = min_n, max_n
        self.ends: dict[tuple[int, ...], list[int]] = {}
        for end in range(1, len(self.tokens) + 1):
            for n in range(min_n, min(max_n, end) + 1):
                self.ends.setdefault(self.tokens[end - n : end], []).append(end)


class Reference:
    """A fixed token sequence indexed by n-gram, read in order: of several occurrences of a suffix,
    the first at or after where the last match left off (the output walks through a predicted file
    from top to bottom, and code repeats its short n-grams)."""

    def __init__(self, index: ReferenceIndex) -> None:
        self.index = index
        self.tokens, self.min_n, self.max_n, self._ends = index.tokens, index.min_n, index.max_n, index.ends
        self._cursor = 0  # where the latest match's continuation starts

    def follow(self, context: Sequence[int], *, longer_than: int = 0, limit: int) -> tuple[int, ...]:
        """Up to `limit` tokens of what followed the context's longest suffix (of more than
        `longer_than` tokens) in the reference; () when no such suffix occurs there."""
        for n in range(min(self.max_n, len(context)), max(self.min_n, longer_than + 1) - 1, -1):
            ends = self._ends.get(tuple(context[len(context) - n :]))
            if ends:  # a common n-gram of a long reference has thousands: found by bisection
                at = bisect_left(ends, self._cursor)
                start = ends[at] if at < len(ends) else ends[-1]
                self._cursor = start
                return self.tokens[start : start + limit]
        return ()
