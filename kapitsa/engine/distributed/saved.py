"""One rank's saved states: its shard's K/V and fixed-size state at positions rank 0 chose, by id.

Rank 0 keeps the index (which token prefix each id holds, prefix.py) and names the ids in its
commands; every rank saves, restores and forgets the same ids at the same command, each with its
own layers (pipeline) or head slices (tensor). Hybrid layers cannot be trimmed, so a state is
restorable only where it was saved: the end of the system part, the end of the last message, the
end of a finished request.

K/V is kept as spans of positions, each detached once and shared: a state saved at the end of a
request holds the spans of the state it was restored from plus the positions computed since, so a
conversation's turns share their common K/V. Fixed-size state is kept by reference (cache/snapshot.py).
Each running request (the one being prefilled, each row of the decode batch) has its own `Live`
spans: the detached K/V it shares with the states it was restored from and saved.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from kapitsa.engine.cache import snapshot
from kapitsa.engine.cache.hybrid import HybridCache

Span = tuple[mx.array, ...]  # one position range of every K/V array, in `snapshot.kv_span`'s order


@dataclass(frozen=True, slots=True)
class SavedState:
    pos: int  # tokens it holds
    spans: tuple[Span, ...]  # K/V of [0, pos), in order
    fixed: tuple[mx.array, ...]  # recurrent layers' and sliding windows' state at pos


@dataclass(slots=True)
class Live:
    """Detached K/V of a running request's first `end` positions, as spans."""

    spans: list[Span] = field(default_factory=list)
    end: int = 0


class SavedStates:
    """This rank's states by id.

    Args:
        probe: an empty batch-1 cache of this rank's layers (which ones hold K/V, which fixed state).
    """

    def __init__(self, probe: HybridCache) -> None:
        self.kv_layers = snapshot.kv_layer_ids(probe)
        self.fixed_layers = snapshot.fixed_layer_ids(probe)
        self._saved: dict[int, SavedState] = {}

    def __len__(self) -> int:
        return len(self._saved)

    def started(self, cache: HybridCache, state_id: int) -> Live:
        """Fill `cache` (empty) with saved state `state_id` (0 leaves it empty); its live spans."""
        saved = self._saved.get(state_id) if state_id else None
        if state_id and saved is None:
            raise KeyError(f"no saved state {state_id} on this rank")
        if saved is not None:
            kv = [mx.concatenate(parts, axis=snapshot.KV_AXIS) for parts in zip(*saved.spans, strict=True)]
            snapshot.fill(
                cache,
                pos=saved.pos,
                kv=kv,
                fixed=saved.fixed,
                kv_layers=self.kv_layers,
                fixed_layers=self.fixed_layers,
            )
            # the copy runs here, not inside the first forward, whose deadline follows its tokens
            mx.eval(*cache.state_arrays())
        return Live() if saved is None else Live(list(saved.spans), saved.pos)

    def save(self, state_id: int, cache: HybridCache, live: Live) -> None:
        """Keep a running request's batch-1 `cache` as it stands (all `cache.offsets[0]` tokens) as
        `state_id`; `live` (its spans) grows to that position."""
        pos = cache.offsets[0]
        if pos < live.end:
            raise ValueError(f"a state at {pos} tokens, below the {live.end} already kept")
        if pos > live.end and self.kv_layers:
            span = snapshot.kv_span(cache, self.kv_layers, live.end, pos)
            live.spans.append(tuple(mx.contiguous(a) for a in span))  # a view would keep the buffer
        live.end = pos
        fixed = snapshot.fixed_state(cache, self.fixed_layers)
        self._saved[state_id] = SavedState(pos, tuple(live.spans), fixed)
        mx.eval(*(a for span in live.spans for a in span), *fixed)

    def ids(self) -> list[int]:
        return sorted(self._saved)

    def forget(self, state_id: int) -> None:
        self._saved.pop(state_id, None)

    def nbytes(self, ids: list[int] | None = None) -> int:
        """Bytes the states `ids` (None: all) hold, each array counted once."""
        states = self._saved.values() if ids is None else [self._saved[i] for i in ids if i in self._saved]
        arrays = {id(a): a for s in states for a in (*(x for span in s.spans for x in span), *s.fixed)}
        return sum(a.nbytes for a in arrays.values())
