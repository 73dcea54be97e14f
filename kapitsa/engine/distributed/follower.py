"""A rank other than 0: run each step rank 0 broadcasts, on this rank's shard, until it says stop."""

from __future__ import annotations

import time

from kapitsa.engine.distributed.control import Op, broadcast
from kapitsa.engine.distributed.group import HEARTBEAT_S, Group, PeerLost, hard_exit
from kapitsa.engine.distributed.watchdog import StepClock, Watchdog


def follow(shard, group: Group, *, clock: StepClock | None = None) -> None:  # noqa: ANN001 - a Shard
    """Block on rank 0's commands and run them; returns when rank 0 stops the group.

    A peer that is lost (a closed connection) or silent past `clock`'s deadline ends this process:
    a rank blocked in a collective cannot be unblocked, and the group cannot go on without it.
    """

    def silent(what: str) -> None:
        hard_exit(f"rank {group.rank}: no word from the group ({what}); stopping")

    clock = clock or StepClock()
    watchdog = Watchdog(silent)
    last_tokens = 1  # the wait for the next command covers the later ranks' share of the last step
    while True:
        watchdog.arm("waiting for rank 0", max(clock.deadline(last_tokens), 5 * HEARTBEAT_S))
        try:
            command = broadcast(group, None)
            if command.op is Op.STOP:
                return
            shard.caches.apply(command)
            if command.op is Op.FORWARD:
                last_tokens = command.paced_as
                watchdog.arm("a forward", clock.deadline(last_tokens, command.warm_key))
                started = time.perf_counter()
                shard.step(shard.caches.target(command), command.rows, command.record)
                clock.record(last_tokens, time.perf_counter() - started, command.warm_key)
        except PeerLost as err:
            hard_exit(f"rank {group.rank}: {err}; stopping")
        finally:
            watchdog.disarm()
