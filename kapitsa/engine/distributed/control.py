"""Rank 0's decision for each step, broadcast to every rank as a small int array.

A command is a header `[op, token count, flags, 0]` then (for a forward) the token ids; both go
out as an `all_sum` in which only rank 0 contributes non-zeros, so every rank holds rank 0's
values exactly. Followers block on the next command; rank 0 sends `IDLE` every `HEARTBEAT_S`
while it has nothing to run, so a follower's watchdog can tell an idle group from a dead one.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import mlx.core as mx

from kapitsa.engine.distributed.group import Group, evaluate

_HEADER = 4
NEW_CACHE = 1  # flags bit: start a fresh cache (a new request) before this forward


class Op(enum.IntEnum):
    IDLE = 0
    FORWARD = 1
    STOP = 2


@dataclass(frozen=True, slots=True)
class Command:
    op: Op
    tokens: tuple[int, ...] = ()
    new_cache: bool = False


def broadcast(group: Group, command: Command | None) -> Command:
    """Rank 0 passes its `command` (others pass None); every rank returns rank 0's command."""
    if group.is_driver:
        assert command is not None
        header = [int(command.op), len(command.tokens), NEW_CACHE if command.new_cache else 0, 0]
    else:
        header = [0] * _HEADER
    summed = mx.distributed.all_sum(mx.array(header, dtype=mx.int32), group=group.handle)
    evaluate(summed, what="a control broadcast")
    op, count, flags, _ = summed.tolist()
    if count == 0:
        return Command(Op(op), (), bool(flags & NEW_CACHE))
    tokens = list(command.tokens) if group.is_driver else [0] * count
    ids = mx.distributed.all_sum(mx.array(tokens, dtype=mx.int32), group=group.handle)
    evaluate(ids, what="a control broadcast")
    return Command(Op(op), tuple(ids.tolist()), bool(flags & NEW_CACHE))
