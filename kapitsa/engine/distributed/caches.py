"""One rank's running caches: the decode batch (a row per decoding request) and the request being
prefilled, changed by each command's bookkeeping in the order control.py gives.

Rank 0 and every follower apply the same commands, so their batches hold the same rows in the same
order: a row is named by its index. A prefilled request joins as the last row (`HybridCache.merge`:
rows at different offsets, which attention handles per row), finished rows leave together
(`filter`), and a row's state is saved from a batch-1 copy of it (`extract`).
"""

from __future__ import annotations

import mlx.core as mx

from kapitsa.engine.cache.hybrid import HybridCache
from kapitsa.engine.distributed.control import Command
from kapitsa.engine.distributed.saved import Live, SavedStates


class RankCaches:
    """The batch and the prefill cache of one rank, with each request's live K/V spans (saved.py).

    Args:
        saved: this rank's saved states.
        new_cache: makes an empty batch-1 cache of this rank's layers.
    """

    def __init__(self, saved: SavedStates, new_cache) -> None:  # noqa: ANN001 - Callable[[], HybridCache]
        self.saved, self._new_cache = saved, new_cache
        self.batch: HybridCache | None = None
        self.batch_live: list[Live] = []
        self.prefill: HybridCache | None = None
        self.prefill_live = Live()

    @property
    def rows(self) -> int:
        return 0 if self.batch is None else self.batch.batch_size

    def apply(self, command: Command) -> None:
        """`command`'s bookkeeping: drop, save, forget, leave, then a new prefill cache and a join."""
        if self.batch is not None and command.drop:
            self.batch.rollback([command.drop] * self.batch.batch_size)
        if command.save:
            self._save(command.save, command.row)
        if command.forget:
            self.saved.forget(command.forget)
        if command.leave:
            self._leave(command.leave)
        if command.new_cache:
            self.prefill = self._new_cache()
            self.prefill_live = self.saved.started(self.prefill, command.restore)
        if command.join:
            self._join()

    def target(self, command: Command) -> HybridCache:
        """The cache `command`'s forward runs on."""
        cache = self.batch if command.batch else self.prefill
        assert cache is not None, "a forward on a cache that no command started"
        return cache

    def _save(self, state_id: int, row: int) -> None:
        if row == 0:
            assert self.prefill is not None
            self.saved.save(state_id, self.prefill, self.prefill_live)
            return
        assert self.batch is not None
        self.saved.save(state_id, self.batch.extract(row - 1), self.batch_live[row - 1])

    def _leave(self, mask: int) -> None:
        assert self.batch is not None
        keep = [r for r in range(self.batch.batch_size) if not mask >> r & 1]
        self.batch_live = [self.batch_live[r] for r in keep]
        if not keep:
            self.batch = None
            return
        self.batch.filter(keep)
        mx.eval(*self.batch.state_arrays())

    def _join(self) -> None:
        assert self.prefill is not None
        self.batch = self.prefill if self.batch is None else HybridCache.merge([self.batch, self.prefill])
        self.batch_live.append(self.prefill_live)
        self.prefill, self.prefill_live = None, Live()
        mx.eval(*self.batch.state_arrays())
