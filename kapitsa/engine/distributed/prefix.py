"""Rank 0's prefix cache for a group: which token prefix each saved state holds, which to evict.

The states themselves live on every rank (saved.py); rank 0 names them by id in its commands
(control.py), so every rank saves, restores and forgets the same ids at the same step. A prompt
resumes from the deepest saved state its tokens start with, short of its last token (a state
holds no next-token logits: at least one token is computed). Eviction takes the least recently
used states first, system prompts last (as the single engine's prefix cache without a resident
policy), until rank 0's states fit the budget; the other ranks' shards hold about as much each
(tensor parallel: the same slices; pipeline: about as many layers).
"""

from __future__ import annotations

import array
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from kapitsa.engine.distributed.saved import SavedStates
from kapitsa.engine.runner.memory import device_memory_limit


@dataclass(slots=True)
class _Entry:
    tokens: array.array  # the prefix the state holds (4 bytes a token)
    kind: str  # "system" | "turn" | "final" (where it was taken)
    last_used: int


def default_budget() -> int:
    """A quarter of the memory left next to the weights, as the single engine's default."""
    return max(0, device_memory_limit() - mx.get_active_memory()) // 4


class GroupPrefix:
    """The index of saved states, on rank 0.

    Args:
        states: rank 0's saved states (their bytes stand for each rank's).
        budget_bytes: what rank 0's states may hold; 0 turns the prefix cache off.
    """

    def __init__(self, states: SavedStates, budget_bytes: int) -> None:
        self.states, self.budget_bytes = states, budget_bytes
        self._entries: dict[int, _Entry] = {}
        self._ids = itertools.count(1)
        self._clock = itertools.count(1)

    def __len__(self) -> int:
        return len(self._entries)

    def ids(self) -> list[int]:
        return sorted(self._entries)

    def lookup(self, key_ids: Sequence[int]) -> tuple[int, int]:
        """(id, tokens held) of the deepest state `key_ids` resume from; (0, 0) when none."""
        best_id, best_pos = 0, 0
        for state_id, entry in self._entries.items():
            pos = len(entry.tokens)
            if best_pos < pos < len(key_ids) and entry.tokens == array.array("i", key_ids[:pos]):
                best_id, best_pos = state_id, pos
        if best_id:
            self._entries[best_id].last_used = next(self._clock)
        return best_id, best_pos

    def add(self, tokens: Sequence[int], kind: str) -> int:
        """A new id for the state after `tokens` (every rank saves it at the next command); 0 when
        the cache is off or a state holds these tokens already."""
        if self.budget_bytes <= 0 or not tokens:
            return 0
        key = array.array("i", tokens)
        for entry in self._entries.values():
            if entry.tokens == key:
                entry.last_used = next(self._clock)
                return 0
        state_id = next(self._ids)
        self._entries[state_id] = _Entry(key, kind, next(self._clock))
        return state_id

    def victims(self) -> list[int]:
        """The ids to forget until rank 0's states fit the budget; they leave the index now (every
        rank frees each at the command that names it)."""
        chosen: list[int] = []
        while self._entries and self.states.nbytes(list(self._entries)) > self.budget_bytes:
            state_id = min(
                self._entries, key=lambda i: (self._entries[i].kind == "system", self._entries[i].last_used)
            )
            del self._entries[state_id]
            chosen.append(state_id)
        return chosen
