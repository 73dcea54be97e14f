"""The prefix cache: prompt tokens reused vs computed, hit rate, checkpoints, memory in use."""

from __future__ import annotations

from textual.widgets import Static

from kapitsa.engine.types import EngineStats
from kapitsa.tui.widgets.formatting import human_bytes


class CachePanel(Static):
    def on_mount(self) -> None:
        self.border_title = "Cache"
        self.update("engine not running")

    def show(self, stats: EngineStats) -> None:
        limit = f" / {human_bytes(stats.memory_limit_bytes)}" if stats.memory_limit_bytes else ""
        self.update(
            f"prompt reused {stats.prompt_tokens_cached:>8}  computed {stats.prompt_tokens_computed:>8}\n"
            f"hit rate      {stats.cache_hit_rate:>8.1%}\n"
            f"checkpoints   {stats.checkpoints_in_memory:>4} in memory ({human_bytes(stats.checkpoint_bytes_in_memory)})"
            f"  {stats.checkpoints_on_disk} on disk ({human_bytes(stats.checkpoint_bytes_on_disk)})\n"
            f"memory        {human_bytes(stats.memory_in_use_bytes)} in use{limit}, peak {human_bytes(stats.memory_peak_bytes)}"
        )
