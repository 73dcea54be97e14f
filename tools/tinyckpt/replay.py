"""Replaying a drafter against the target's greedy continuation (torch-free, so tests need no torch).

Under greedy verification a drafted token is accepted while it equals the target's argmax at that
position, and every verify step also yields the target's own next token; the output is exactly the
target's greedy continuation, so that continuation is computed once and each drafter is replayed on it.
"""

from __future__ import annotations

from collections.abc import Callable

Proposer = Callable[[list[int], int], list[int]]  # (context ids, prompt length) -> draft ids


def replay(sequence: list[int], prompt_len: int, propose: Proposer) -> tuple[int, int, int, int]:
    """Returns (verify steps, generated tokens, drafted tokens, accepted tokens)."""
    position, steps, drafted, accepted = prompt_len, 0, 0, 0
    while position < len(sequence):
        draft = propose(sequence[:position], prompt_len)
        run = 0
        while run < len(draft) and position + run < len(sequence) and draft[run] == sequence[position + run]:
            run += 1
        steps += 1
        drafted += len(draft)
        accepted += run
        position += run + 1
    return steps, len(sequence) - prompt_len, drafted, accepted


def ngram_proposer(k: int, max_n: int = 3) -> Proposer:
    """Prompt lookup: the continuation of the latest earlier occurrence of the last n tokens (n = max_n..1)."""

    def propose(context: list[int], _prompt_len: int) -> list[int]:
        for n in range(max_n, 0, -1):
            if len(context) <= n:
                continue
            tail = context[-n:]
            for start in range(len(context) - n - 1, -1, -1):
                if context[start : start + n] == tail:
                    return context[start + n : start + n + k]
        return []

    return propose
