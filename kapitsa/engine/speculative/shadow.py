"""Scoring a host drafter's guesses against the tokens plain decoding produces.

While speculation rests the engine pipelines plain steps, and a verify forward would cost about
two of them on a GPU. A drafter that works on the host alone (n-gram lookup) can still guess what
follows the committed tokens; checking that guess against the tokens that then arrive tells the
controller how deep drafts would have been accepted, with no verify, no extra graph and no sync.
Under sampling the match rate of a point-mass guess is E[p(guess)], which is exactly the rate at
which speculative sampling would accept it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kapitsa.engine.speculative.controller import DraftLengthController


@dataclass(slots=True)
class ShadowGuess:
    tokens: tuple[int, ...] = ()
    at: int = 0  # the context length the guess continues
    run: int = 0  # the drafter's correct tokens in a row, up to the guess's start
    matched: int = 0  # the live guess's tokens that arrived and matched

    @property
    def live(self) -> bool:
        return bool(self.tokens)

    @property
    def current_run(self) -> int:
        """The drafter's correct tokens in a row at the end of the context scored last."""
        return self.run + self.matched

    def verified(self, proposed: int, accepted: int) -> None:
        """A verify scored a draft: the run goes on only if all of it was accepted."""
        self.clear()
        self.run = self.run + accepted if proposed and accepted == proposed else 0

    def start(self, tokens: Sequence[int], at: int) -> None:
        self.tokens, self.at, self.matched = tuple(int(t) for t in tokens), at, 0

    def guess(self, tokens: Sequence[int], at: int) -> None:
        """Start scoring `tokens` as the continuation of a context of length `at` unless a guess
        is live; an empty guess breaks any run (the next token is not one the drafter saw coming)."""
        if self.tokens:
            return
        self.start(tokens, at)
        if not self.tokens:
            self.run = 0

    def clear(self) -> None:
        self.run, self.tokens, self.matched = self.current_run, (), 0

    def score(self, context: Sequence[int], controller: DraftLengthController) -> None:
        """Compare the live guess with what `context` added after it; once the guess misses or is
        matched in full, fold the result into `controller` as a verify of that draft would."""
        if not self.tokens:
            return
        arrived = min(len(context) - self.at, len(self.tokens))
        if arrived <= 0:
            return
        matched = 0
        while matched < arrived and int(context[self.at + matched]) == self.tokens[matched]:
            matched += 1
        if matched < arrived:
            controller.update(len(self.tokens), matched, self.run)
            self.run, self.tokens, self.matched = 0, (), 0
        elif matched == len(self.tokens):
            controller.update(len(self.tokens), matched, self.run)
            self.run, self.tokens, self.matched = self.run + matched, (), 0
        else:
            self.matched = matched
