"""A rank other than 0: run each step rank 0 broadcasts, on this rank's shard, until it says stop."""

from __future__ import annotations

from kapitsa.engine.cache.hybrid import HybridCache
from kapitsa.engine.distributed.control import Op, broadcast
from kapitsa.engine.distributed.group import Group, PeerLost, Watchdog, hard_exit


def follow(shard, group: Group, *, timeout_s: float) -> None:  # noqa: ANN001 - a Shard
    """Block on rank 0's commands and run them; returns when rank 0 stops the group.

    A peer that is lost (a closed connection) or silent for `timeout_s` ends this process at once:
    a rank blocked in a collective cannot be unblocked, and the group cannot go on without it.
    """

    def silent(what: str) -> None:
        hard_exit(f"rank {group.rank}: no word from the group for {timeout_s:.0f} s ({what}); stopping")

    watchdog = Watchdog(timeout_s, silent)
    cache: HybridCache | None = None
    while True:
        watchdog.arm("waiting for rank 0")
        try:
            command = broadcast(group, None)
            if command.op is Op.STOP:
                return
            if command.op is Op.FORWARD:
                if command.new_cache or cache is None:
                    cache = shard.new_cache()
                watchdog.arm("a forward")
                shard.step(cache, list(command.tokens))
        except PeerLost as err:
            hard_exit(f"rank {group.rank}: {err}; stopping")
        finally:
            watchdog.disarm()
