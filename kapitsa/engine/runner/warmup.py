"""Decode batch sizes made ready while the engine is idle, before a burst of that size arrives.

The first decode step at a new batch size traces the compiled layer steps for that size
(models/base.py) and, on a GPU, compiles the kernels whose launch depends on the row count (the
tensor-core mat-vec's row blocks, the MoE expert kernels' capacity, MLX's own quantized mat-muls
past a few rows; on Metal, the kernels that take the row count as a template): on the H200 a
server's first burst of 4 or 16 streams stalls 30-80 s on them. The engine instead runs throwaway
steps at each size of `EngineConfig.warm_batches` whenever it has nothing else to do, smallest
first, so a burst finds them ready. It covers plain decode steps (what serve's default `auto`
speculation runs while drafts do not pay), not speculative verifies; every size's step is built
before the first runs, and none runs until the kernels those builds handed to the compile workers
are on disk (kernels/cuda_disk_cache.py), so on CUDA they compile side by side. Then, where
`EngineConfig.warm_prefill` asks, it prefills throwaway chunks of the lengths a prompt's chunks
compile kernels for (the recurrent kernels' token counts: gdn_prefill.py pads a chunk past 16
tokens to a power of two, masked when it was shorter, and runs shorter ones at their own count),
from an empty cache and after a first chunk, so a first request's prompt finds them compiled;
every chunk is built before the first runs, so their kernels also compile side by side. A request, abort or stop that arrives
meanwhile waits at most for one throwaway step: the warm-up checks between steps and resumes
later.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import mlx.core as mx

from kapitsa.engine.cache.hybrid import HybridCache
from kapitsa.engine.cache.layers import KV_STEP
from kapitsa.engine.kernels import cuda_disk_cache
from kapitsa.engine.models.base import CHAIN_MAX_T
from kapitsa.engine.options import EngineConfig
from kapitsa.engine.runner.memory import MemoryBudget
from kapitsa.engine.runner.model_runner import ModelRunner

log = logging.getLogger(__name__)

# Tokens the throwaway sequences hold before a step: rows of 1 to 4 tokens (lengths that differ,
# as in a batch whose streams arrived at different times; and all equal, as an `n > 1` request's
# choices are), each built by one-row decode steps: longer chains would trace and compile the
# short-chain (verify) paths, which are not what the warm-up is for.
WARM_LENGTHS = 4
# A first chunk's tokens before a throwaway "continued" one: the fresh 31-token chunk's length, whose
# kernels are compiled by then (at most the engine's chunk)
FIRST_CHUNK = 31
# How long one idle turn waits for the built steps' kernels to compile before it hands the engine
# thread back to its inbox (a request that arrives meanwhile waits at most this long)
COMPILE_WAIT_S = 0.05


def _first_chunk(tokens: int, after: bool) -> int:
    """Tokens a throwaway chunk of `tokens` follows: a first chunk's when it is a continued one."""
    return min(FIRST_CHUNK, tokens) if after else 0


def default_warm_batches(max_running: int, on_gpu: bool) -> tuple[int, ...]:
    """The batch sizes an engine warms when its config leaves them unset: every size up to its
    largest batch on a GPU (a burst of N streams forms each size below N as its streams join and
    leave); none on the CPU, where a new size costs only its traces (milliseconds for the demo)."""
    return tuple(range(1, max_running + 1)) if on_gpu else ()


def default_warm_prefill(prefill_chunk: int, on_cuda: bool) -> tuple[int, ...]:
    """On CUDA: every length up to CHAIN_MAX_T (short chunks run the recurrent kernels at their
    exact token count, and a continued one the compiled short-chain step of that count: a prompt's
    remainder after a prefix-cache hit, a chat's short next turn), one token short of each power of
    two from 32 up to the chunk (a padded, masked call at that length) and the chunk itself (a long
    prompt's full chunks); none elsewhere (the CPU's reference path compiles nothing per length,
    and Metal runs no custom kernels by default)."""
    if not on_cuda:
        return ()
    lengths = {prefill_chunk, *range(1, min(CHAIN_MAX_T, prefill_chunk) + 1)}
    power = 32
    while power <= prefill_chunk:
        lengths.add(power - 1)
        power *= 2
    return tuple(sorted(lengths))


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
        prefill_lengths: Sequence[int] = (),
    ) -> None:
        self.pending = sorted(set(sizes))
        # (tokens, after a first chunk) of each throwaway prefill still to run, after the sizes
        self.prefill_pending = [(n, after) for n in sorted(set(prefill_lengths)) for after in (False, True)]
        self.seconds = 0.0  # spent warming so far
        self.memory, self.prefix, self.busy = memory, prefix, busy
        self._bases: list[HybridCache] = []  # one-row caches of 1..WARM_LENGTHS tokens, while warming
        self._built: set[int] = set()  # sizes whose steps were built ahead (`build_decode_step`)
        self._prefills_built: set[tuple[int, bool]] = set()  # chunks built ahead (`build_prefill`)
        self._waiting_since: float | None = None  # when the turns began to wait for compiles

    @classmethod
    def for_config(cls, config: EngineConfig, memory: MemoryBudget, prefix, inbox) -> BatchWarmup:  # noqa: ANN001
        """The config's `warm_batches` (where unset, this device's defaults), yielding to anything
        that arrives in the engine's `inbox` (a queue)."""
        on_gpu = mx.default_device().type == mx.gpu
        sizes, lengths = config.warm_batches, config.warm_prefill
        if sizes is None:
            sizes = default_warm_batches(config.max_running, on_gpu)
        if lengths is None:  # only CUDA's custom kernels compile per prefill length by default
            lengths = default_warm_prefill(config.prefill_chunk, on_gpu and mx.cuda.is_available())
        return cls(sizes, memory, prefix, busy=lambda: not inbox.empty(), prefill_lengths=lengths)

    @property
    def num_pending(self) -> int:
        return len(self.pending) + len(self.prefill_pending)

    def run_one(self, runner: ModelRunner) -> bool:
        """Warm (some of) the next size; False when none is left or work has arrived. A size whose
        state does not fit now, or a failure (logged), ends the warm-up: the engine serves as it
        would have without it. A size leaves `pending` once it is ready."""
        if not self.pending:
            self._bases = []
            return self._prefill_one(runner)
        if self.busy():
            return False
        rows = self.pending[0]
        if not self._fits(rows):
            log.info("not warming decode batches of %d rows or more: their state does not fit now", rows)
            self._give_up()
            return True
        started = time.perf_counter()
        try:
            bases = self._base_caches(runner)
            if bases and not self._build_ahead(runner, bases):
                return False  # work arrived between two builds
            if self._compiling():
                self.seconds += time.perf_counter() - started
                return True  # the built steps' kernels are still compiling: run them once on disk
            done = warm_decode_step(runner, rows, bases, self.busy)
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

    def _build_ahead(self, runner: ModelRunner, bases: list[HybridCache]) -> bool:
        """Build every pending size's step that fits before the first runs (`build_decode_step`);
        False if `busy()` cut it short (the rest are built on a later turn)."""
        for size in filter(self._fits, self.pending):
            if size not in self._built:
                if self.busy():
                    return False
                build_decode_step(runner, size, bases)
                self._built.add(size)
        return True

    def _prefill_one(self, runner: ModelRunner) -> bool:
        """The next throwaway prefill chunk; False when none is left or work has arrived."""
        if not self.prefill_pending or self.busy():
            return False
        started, cache = time.perf_counter(), None
        try:
            if not self._build_prefills(runner):
                return False  # work arrived between two builds (the rest are built on a later turn)
        except Exception:  # noqa: BLE001 - an optional speed-up must never stop the engine
            log.exception("building the prefill chunks ahead failed; they compile as they run")
            self._prefills_built.update(self.prefill_pending)
        if self._compiling():
            self.seconds += time.perf_counter() - started
            return True  # the chunks' kernels are still compiling: run them once on disk
        tokens, after = self.prefill_pending[0]
        if not self._prefill_fits(tokens, after):
            self.prefill_pending.pop(0)  # not now: this one is left out, the smaller ones ran already
            return True
        first = _first_chunk(tokens, after)
        try:
            cache = runner.new_cache()
            if after:
                runner.prefill(cache, [0] * first)
            runner.prefill(cache, [0] * tokens, start=first)
        except Exception:  # noqa: BLE001 - an optional speed-up must never stop the engine
            log.exception("warming prefill chunks of %d tokens failed; skipping the rest", tokens)
            self.prefill_pending.clear()
        else:
            self.prefill_pending.pop(0)  # pending until done: a client waiting on the count sees it end
        del cache
        mx.clear_cache()
        self.seconds += time.perf_counter() - started
        if not self.prefill_pending:
            log.info("prefill chunks ready (%.1f s of warm-up in all)", self.seconds)
        return True

    def _build_prefills(self, runner: ModelRunner) -> bool:
        """Build every pending throwaway chunk that fits (never run) before the first runs:
        building hands their kernels to the compile workers, so the lengths compile side by side.
        False if `busy()` cut it short."""
        for chunk in self.prefill_pending:
            if chunk in self._prefills_built:
                continue
            if self.busy():
                return False
            self._prefills_built.add(chunk)
            tokens, after = chunk
            if not self._prefill_fits(tokens, after):
                continue
            cache = runner.new_cache()
            first = _first_chunk(tokens, after)
            if first:
                runner.build_prefill(cache, [0] * first)
            runner.build_prefill(cache, [0] * tokens)
        return True

    def _prefill_fits(self, tokens: int, after: bool) -> bool:
        if self.memory is None:
            return True
        first = _first_chunk(tokens, after)
        cached = self.prefix.nbytes if self.prefix else 0
        return self.memory.fits_now(self.memory.sequence_bytes(first + tokens), other_bytes=cached)

    def _compiling(self) -> bool:
        """Whether kernels handed to the compile workers are still compiling, for at most
        `cuda_disk_cache.WAIT_LIMIT_S` of waiting turns in all: past that the steps run anyway (MLX then
        compiles what is missing itself)."""
        if not cuda_disk_cache.compiles_running(COMPILE_WAIT_S):
            self._waiting_since = None
            return False
        now = time.perf_counter()
        self._waiting_since = self._waiting_since or now
        return now - self._waiting_since < cuda_disk_cache.WAIT_LIMIT_S

    def _base_caches(self, runner: ModelRunner) -> list[HybridCache]:
        if not self._bases:
            for length in range(1, WARM_LENGTHS + 1):
                cache = runner.new_cache()
                for _ in range(length):
                    runner.decode(cache, [0])
                self._bases.append(cache)
        return self._bases

    def _give_up(self) -> None:
        """No more decode sizes (the prefill chunks, one sequence each, may still fit)."""
        self.pending.clear()
        self._bases = []
        mx.clear_cache()

    def _fits(self, rows: int) -> bool:
        if self.memory is None:
            return True
        cached = self.prefix.nbytes if self.prefix is not None else 0
        held = (rows + WARM_LENGTHS) * self.memory.sequence_bytes(KV_STEP)  # the step's rows and the bases
        return self.memory.fits_now(held, other_bytes=cached)


def build_decode_step(runner: ModelRunner, rows: int, bases: Sequence[HybridCache]) -> None:
    """A decode step of `rows` throwaway rows, built and never run: building hands each custom kernel
    it launches to the compile workers (kernels/cuda_disk_cache.py), so the sizes' kernels compile
    side by side instead of one size after another as their steps run."""
    batch = HybridCache.merge([bases[r % len(bases)] for r in range(rows)])
    runner.decode_lazy(batch, mx.zeros((rows,), dtype=mx.int32))


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
