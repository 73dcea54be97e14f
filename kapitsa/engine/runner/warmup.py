"""Decode batch sizes made ready while the engine is idle, before a burst of that size arrives.

The first decode step at a new batch size traces the compiled layer steps for that size
(models/base.py) and, on a GPU, compiles the kernels whose launch depends on the row count (the
tensor-core mat-vec's row blocks, the MoE expert kernels' capacity, MLX's own quantized mat-muls
past a few rows; on Metal, the kernels that take the row count as a template): on the H200 a
server's first burst of 4 or 16 streams stalls 30-80 s on them. The engine instead runs throwaway
steps at each size of `EngineConfig.warm_batches` whenever it has nothing else to do, smallest
first, so a burst finds them ready. It covers plain decode steps (what serve's default `auto`
speculation runs while drafts do not pay), not speculative verifies. A request, abort or stop that
arrives meanwhile waits at most for one throwaway step: the warm-up checks between steps and
resumes later.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import mlx.core as mx

from kapitsa.engine.cache.hybrid import HybridCache
from kapitsa.engine.cache.layers import KV_STEP
from kapitsa.engine.options import EngineConfig
from kapitsa.engine.runner.memory import MemoryBudget
from kapitsa.engine.runner.model_runner import ModelRunner

log = logging.getLogger(__name__)

# Tokens the throwaway sequences hold before a step: rows of 1 to 4 tokens (lengths that differ,
# as in a batch whose streams arrived at different times; and all equal, as an `n > 1` request's
# choices are), each built by one-row decode steps: longer chains would trace and compile the
# short-chain (verify) paths, which are not what the warm-up is for.
WARM_LENGTHS = 4


def default_warm_batches(max_running: int, on_gpu: bool) -> tuple[int, ...]:
    """The batch sizes an engine warms when its config leaves them unset: every size up to its
    largest batch on a GPU (a burst of N streams forms each size below N as its streams join and
    leave); none on the CPU, where a new size costs only its traces (milliseconds for the demo)."""
    return tuple(range(1, max_running + 1)) if on_gpu else ()


class BatchWarmup:
    """The sizes still to warm, one per idle turn of the engine thread, each only while its
    throwaway state fits next to the prefix cache (`prefix`: anything with `nbytes`, or None);
    `busy()` says that work has arrived (the engine's inbox is not empty)."""

    def __init__(
        self,
        sizes: Sequence[int],
        memory: MemoryBudget | None = None,
        prefix=None,  # noqa: ANN001
        busy: Callable[[], bool] = lambda: False,
    ) -> None:
        self.pending = sorted(set(sizes))
        self.seconds = 0.0  # spent warming so far
        self.memory, self.prefix, self.busy = memory, prefix, busy
        self._bases: list[HybridCache] = []  # one-row caches of 1..WARM_LENGTHS tokens, while warming

    @classmethod
    def for_config(cls, config: EngineConfig, memory: MemoryBudget, prefix, inbox) -> BatchWarmup:  # noqa: ANN001
        """The config's `warm_batches` (where unset, this device's defaults), yielding to anything
        that arrives in the engine's `inbox` (a queue)."""
        sizes = config.warm_batches
        if sizes is None:
            sizes = default_warm_batches(config.max_running, mx.default_device().type == mx.gpu)
        return cls(sizes, memory, prefix, busy=lambda: not inbox.empty())

    def run_one(self, runner: ModelRunner) -> bool:
        """Warm (some of) the next size; False when none is left or work has arrived. A size whose
        state does not fit now, or a failure (logged), ends the warm-up: the engine serves as it
        would have without it. A size leaves `pending` once it is ready."""
        if not self.pending:
            self._bases = []
            return False
        if self.busy():
            return False
        rows = self.pending[0]
        if not self._fits(rows):
            log.info("not warming decode batches of %d rows or more: their state does not fit now", rows)
            self._give_up()
            return True
        started = time.perf_counter()
        try:
            done = warm_decode_step(runner, rows, self._base_caches(runner), self.busy)
        except Exception:  # noqa: BLE001 - an optional speed-up must never stop the engine
            log.exception("warming decode batches of %d rows failed; skipping the rest", rows)
            self._give_up()
            return True
        elapsed = time.perf_counter() - started
        self.seconds += elapsed
        if done:
            self.pending.pop(0)
            log.info("decode batches of %d rows ready (%.1f s)", rows, elapsed)
        return True

    def _base_caches(self, runner: ModelRunner) -> list[HybridCache]:
        if not self._bases:
            for length in range(1, WARM_LENGTHS + 1):
                cache = runner.new_cache()
                for _ in range(length):
                    runner.decode(cache, [0])
                self._bases.append(cache)
        return self._bases

    def _give_up(self) -> None:
        self.pending.clear()
        self._bases = []
        mx.clear_cache()

    def _fits(self, rows: int) -> bool:
        if self.memory is None:
            return True
        cached = self.prefix.nbytes if self.prefix is not None else 0
        held = (rows + WARM_LENGTHS) * self.memory.sequence_bytes(KV_STEP)  # the step's rows and the bases
        return self.memory.fits_now(held, other_bytes=cached)


def warm_decode_step(
    runner: ModelRunner, rows: int, bases: Sequence[HybridCache], busy: Callable[[], bool]
) -> bool:
    """Decode steps of `rows` throwaway sequences as the engine's batch runs them: rows of different
    lengths, then (2 rows or more) of one length. False if `busy()` cut it short."""
    layouts = [[bases[r % len(bases)] for r in range(rows)]]
    if rows > 1:
        layouts.append([bases[0]] * rows)
    for layout in layouts:
        if busy():
            return False
        batch = HybridCache.merge(layout)  # a new cache: the bases stay as they are
        logits = runner.decode_lazy(batch, mx.zeros((rows,), dtype=mx.int32))
        mx.eval(mx.argmax(logits, axis=-1), *batch.state_arrays())
        del batch, logits
    mx.clear_cache()  # the throwaway state's buffers go back rather than stay cached
    return True
