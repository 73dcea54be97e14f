"""Rank 0's decision for each step, broadcast to every rank as a small int array.

A command is one `all_sum` of `[op, token count, flags, 0, first INLINE token ids]` in which only
rank 0 contributes non-zeros, so every rank holds rank 0's values exactly; a prompt chunk longer
than `INLINE` tokens sends the rest in a second one, so a decode step costs one collective (each
is a network round trip: lab/runs/distributed-cpu.log). Followers block on the next command;
rank 0 sends `IDLE` every `HEARTBEAT_S` while it has nothing to run, so a follower's watchdog can
tell an idle group from a dead one.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import mlx.core as mx

from kapitsa.engine.distributed.group import Group, evaluate

_HEADER = 4
INLINE = 8  # token ids that ride in the header
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
        tokens = list(command.tokens)
        flags = NEW_CACHE if command.new_cache else 0
        block = [int(command.op), len(tokens), flags, 0, *tokens[:INLINE]]
        block += [0] * (_HEADER + INLINE - len(block))
    else:
        block = [0] * (_HEADER + INLINE)
    summed = _sum(group, block)
    op, count, flags, _ = summed[:_HEADER]
    ids = summed[_HEADER : _HEADER + min(count, INLINE)]
    if count > INLINE:
        ids += _sum(group, tokens[INLINE:] if group.is_driver else [0] * (count - INLINE))
    return Command(Op(op), tuple(ids), bool(flags & NEW_CACHE))


def _sum(group: Group, values: list[int]) -> list[int]:
    summed = mx.distributed.all_sum(mx.array(values, dtype=mx.int32), group=group.handle)
    evaluate(summed, what="a control broadcast")
    return summed.tolist()
