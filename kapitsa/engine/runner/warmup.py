"""Decode batch sizes made ready while the engine is idle, before a burst of that size arrives.

The first decode step at a new batch size traces the compiled layer steps for that size
(models/base.py) and, on a GPU, compiles the kernels whose launch depends on the row count (the
tensor-core mat-vec's row blocks, the MoE expert kernels' capacity, MLX's own quantized mat-muls
past a few rows): on the H200 that stalled a server's first burst of 4 or 16 streams for 30-80 s.
The engine instead runs one throwaway step at each size of `EngineConfig.warm_batches` whenever it
has nothing else to do, smallest first, so a burst finds them ready; a request that arrives
meanwhile waits at most for the one size being warmed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import mlx.core as mx

from kapitsa.engine.cache.hybrid import HybridCache
from kapitsa.engine.cache.layers import KV_STEP
from kapitsa.engine.options import EngineConfig
from kapitsa.engine.runner.memory import MemoryBudget
from kapitsa.engine.runner.model_runner import ModelRunner

log = logging.getLogger(__name__)

# Tokens each throwaway sequence holds before the step, by row (1 to 4, so the rows differ in length as
# a real batch's do), each fed as a one-row decode step: longer chains would trace and compile the
# short-chain (verify) paths, which are not what the warm-up is for.
WARM_LENGTHS = 4


def default_warm_batches(max_running: int, on_gpu: bool) -> tuple[int, ...]:
    """The batch sizes an engine warms when its config leaves them unset: every size up to its
    largest batch on a GPU (a burst of N streams forms each size below N as its streams join and
    leave); none on the CPU, where a new size costs only its traces (milliseconds for the demo)."""
    return tuple(range(1, max_running + 1)) if on_gpu else ()


class BatchWarmup:
    """The sizes still to warm, one per idle turn of the engine thread, each only while its
    throwaway state fits next to the prefix cache (`prefix`: anything with `nbytes`, or None)."""

    def __init__(self, sizes: Sequence[int], memory: MemoryBudget | None = None, prefix=None) -> None:  # noqa: ANN001
        self.pending = sorted(set(sizes))
        self.seconds = 0.0  # spent warming so far
        self.memory, self.prefix = memory, prefix

    @classmethod
    def for_config(cls, config: EngineConfig, memory: MemoryBudget, prefix) -> BatchWarmup:  # noqa: ANN001
        """The config's `warm_batches`, or where unset the defaults for this device."""
        sizes = config.warm_batches
        if sizes is None:
            sizes = default_warm_batches(config.max_running, mx.default_device().type == mx.gpu)
        return cls(sizes, memory, prefix)

    def run_one(self, runner: ModelRunner) -> bool:
        """Warm the next size; False when none is left. A size whose state does not fit now, or a
        failure (logged), ends the warm-up: the engine serves as it would have without it. A size
        leaves `pending` once it is ready."""
        if not self.pending:
            return False
        rows = self.pending[0]
        if not self._fits(rows):
            log.info("not warming decode batches of %d rows or more: their state does not fit now", rows)
            self.pending.clear()
            return True
        started = time.perf_counter()
        try:
            warm_decode_step(runner, rows)
        except Exception:  # noqa: BLE001 - an optional speed-up must never stop the engine
            log.exception("warming decode batches of %d rows failed; skipping the rest", rows)
            self.pending.clear()
            return True
        elapsed = time.perf_counter() - started
        self.seconds += elapsed
        self.pending.pop(0)
        log.info("decode batches of %d rows ready (%.1f s)", rows, elapsed)
        return True

    def _fits(self, rows: int) -> bool:
        if self.memory is None:
            return True
        cached = self.prefix.nbytes if self.prefix is not None else 0
        return self.memory.fits_now(rows * self.memory.sequence_bytes(KV_STEP), other_bytes=cached)


def warm_decode_step(runner: ModelRunner, rows: int) -> None:
    """One decode step of `rows` throwaway sequences, as the engine's batch would run it."""
    caches = []
    for row in range(rows):
        cache = runner.new_cache()
        for _ in range(1 + row % WARM_LENGTHS):
            runner.decode(cache, [0])
        caches.append(cache)
    batch = caches[0] if rows == 1 else HybridCache.merge(caches)
    logits = runner.decode_lazy(batch, mx.zeros((rows,), dtype=mx.int32))
    mx.eval(mx.argmax(logits, axis=-1), *batch.state_arrays())
    del caches, batch, logits
    mx.clear_cache()  # the throwaway state's buffers go back rather than stay cached
