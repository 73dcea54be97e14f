"""The prefix cache: prompt tokens reused vs computed, hit rate, checkpoints, resident conversations,
memory in use."""

from __future__ import annotations

from textual.widgets import Static

from kapitsa.engine.types import EngineStats
from kapitsa.units import format_bytes


class CachePanel(Static):
    def on_mount(self) -> None:
        self.border_title = "Cache"
        self.update("engine not running")

    def show(self, stats: EngineStats) -> None:
        limit = f" / {format_bytes(stats.memory_limit_bytes)}" if stats.memory_limit_bytes else ""
        self.update(
            f"prompt tokens reused   {stats.prompt_tokens_cached:>9}\n"
            f"prompt tokens computed {stats.prompt_tokens_computed:>9}\n"
            f"hit rate               {stats.cache_hit_rate:>9.1%}\n"
            f"checkpoints  {stats.checkpoints_in_memory:>3} in memory {format_bytes(stats.checkpoint_bytes_in_memory):>9}\n"
            f"             {stats.checkpoints_on_disk:>3} on disk   {format_bytes(stats.checkpoint_bytes_on_disk):>9}\n"
            f"conversations{stats.resident_conversations:>3} kept of{stats.conversations_in_memory:>3}"
            f"{format_bytes(stats.resident_bytes):>9}\n"
            f"memory {format_bytes(stats.memory_in_use_bytes)}{limit}\n"
            f"peak   {format_bytes(stats.memory_peak_bytes)}"
        )
