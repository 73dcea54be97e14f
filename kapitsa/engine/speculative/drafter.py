"""The drafter interface: given the committed tokens, propose what comes next."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(slots=True, frozen=True)
class Draft:
    """A chain of proposed tokens. They are point masses (n-gram copies, argmax drafts): the
    engine's sampling acceptance (acceptance.py) is exact for those."""

    tokens: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.tokens)


class Drafter(Protocol):
    name: str

    def propose(self, context: Sequence[int], max_tokens: int) -> Draft:
        """Propose up to `max_tokens` tokens that follow `context` (prompt + committed output)."""
        ...

    def observe(self, new_tokens: Sequence[int]) -> None:
        """Tell the drafter which tokens were committed since the last call."""
        ...


def new_tokens(context: Sequence[int], known: Sequence[int]) -> list[int] | None:
    """The tokens `context` adds after `known` when it extends it, else None (start over).

    A drafter is made per sequence, and a sequence's context only grows by committed tokens, so
    the check is O(1): the length and both ends of `known`, not a copy and compare of the whole
    context each step (~0.5 ms of Python at 30k tokens). A context that differs only inside is
    taken for an extension; that can only cost draft quality, never output (drafts are verified)."""
    k = len(known)
    if k > len(context) or (k and (context[0] != known[0] or context[k - 1] != known[-1])):
        return None
    return list(context[k:])
