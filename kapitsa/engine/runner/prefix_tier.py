"""The engine's prefix cache as its config asks for it: the memory budget, the disk tier, and the
resident-conversation policy that decides what eviction spares (cache/resident.py); and the engine
thread's two prefetch entry points (a coming prompt's read-ahead, an idle engine's preload of
conversations memory pressure pushed to disk), which log a failure instead of stopping the engine."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kapitsa.engine.cache.disk import DiskTier
from kapitsa.engine.cache.prefix import PrefixCache
from kapitsa.engine.cache.resident import ResidentPolicy
from kapitsa.engine.options import EngineConfig
from kapitsa.engine.runner.memory import MemoryBudget
from kapitsa.engine.runner.model_runner import ModelRunner

log = logging.getLogger(__name__)


def make_prefix_cache(config: EngineConfig, memory: MemoryBudget, runner: ModelRunner) -> PrefixCache | None:
    """None when the budget is 0 (`prefix_cache_bytes=0`, or no memory left next to the weights)."""
    budget = config.prefix_cache_bytes
    if budget is None:
        budget = memory.available_bytes // 4
    if budget <= 0:
        return None
    disk = None
    if config.disk_cache_dir is not None and config.disk_cache_bytes > 0:
        disk = DiskTier(
            config.disk_cache_dir,
            model_key=f"{config.model_key}|{runner.state_key}",  # the CPU computes in float32
            budget_bytes=config.disk_cache_bytes,
            validate=runner.check_stored,
            write_delay_s=config.disk_write_delay_s,
            read_ahead_bytes=config.read_ahead_bytes if config.prefetch else 0,
        )
    resident = ResidentPolicy(config.resident_conversations) if config.resident_conversations else None
    return PrefixCache(budget_bytes=budget, disk=disk, resident=resident)


def preload_one(prefix: PrefixCache | None, memory: MemoryBudget) -> bool:
    """Load one spilled conversation's newest checkpoint back while the engine is idle, if it fits
    next to what is reserved and under the cache's budget; True when one was loaded."""
    if prefix is None or prefix.disk is None:
        return False
    room = min(prefix.budget_bytes, memory.free_bytes) - prefix.nbytes
    try:
        return prefix.preload(room)
    except Exception:  # noqa: BLE001 - a failed preload only loses a cache entry, never the engine
        log.exception("could not preload a checkpoint from disk")
        return False


def read_ahead(prefix: PrefixCache | None, key_ids: Sequence[int]) -> None:
    """Start the read of the disk checkpoint a coming prompt resumes from (on the engine thread)."""
    if prefix is None:
        return
    try:
        prefix.read_ahead(key_ids)
    except Exception:  # noqa: BLE001 - a failed read-ahead leaves the lookup to read the file
        log.exception("could not start reading a checkpoint ahead")
