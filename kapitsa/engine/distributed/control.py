"""Rank 0's decision for each step, broadcast to every rank as a small int array.

A command is one `all_sum` of `[op, token count, flags, drop, first INLINE token ids]` in which
only rank 0 contributes non-zeros, so every rank holds rank 0's values exactly; a prompt chunk
longer than `INLINE` tokens sends the rest in a second one, so a decode step (or a verify of up
to `INLINE` tokens) costs one collective (each is a network round trip:
lab/runs/distributed-cpu.log). Followers block on the next command; rank 0 sends `IDLE` every
`HEARTBEAT_S` while it has nothing to run, so a follower's watchdog can tell an idle group from a
dead one.

Flags: `NEW_CACHE` starts a fresh cache (a new request) before the forward; `RECORD` runs it with
`record=True` (a speculative verify of `[last, d1..dk]`: rank 0 gets every position's logits).
`drop`: how many tokens of the previous forward (a verify) every rank rolls back with
`cache.rollback([drop])` before this one. Rank 0 learns it from the acceptance after the verify,
so it rides in the next command instead of costing a collective of its own; a command with
`NEW_CACHE` (or a `STOP`) makes it moot.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import mlx.core as mx

from kapitsa.engine.distributed.group import Group, evaluate

_HEADER = 4
INLINE = 8  # token ids that ride in the header
NEW_CACHE = 1  # flags bit: start a fresh cache (a new request) before this forward
RECORD = 2  # flags bit: run this forward with replay records and return every position's logits


class Op(enum.IntEnum):
    IDLE = 0
    FORWARD = 1
    STOP = 2


@dataclass(frozen=True, slots=True)
class Command:
    op: Op
    tokens: tuple[int, ...] = ()
    new_cache: bool = False
    record: bool = False
    drop: int = 0  # tokens of the previous forward to roll back before this one

    @property
    def paced_as(self) -> int:
        """The token count whose pace (watchdog.StepClock) this forward's deadline follows: a
        verify costs about one decode step, not its tokens' share of a prefill chunk."""
        return 1 if self.record else len(self.tokens)

    @property
    def warm_key(self) -> tuple[int, int] | None:
        """The speculative shape this forward compiles for on first use (a verify's width, the
        rollback before it); None for plain steps."""
        return (len(self.tokens), self.drop) if self.record or self.drop else None


def broadcast(group: Group, command: Command | None) -> Command:
    """Rank 0 passes its `command` (others pass None); every rank returns rank 0's command."""
    if group.is_driver:
        assert command is not None
        tokens = list(command.tokens)
        flags = (NEW_CACHE if command.new_cache else 0) | (RECORD if command.record else 0)
        block = [int(command.op), len(tokens), flags, command.drop, *tokens[:INLINE]]
        block += [0] * (_HEADER + INLINE - len(block))
    else:
        block = [0] * (_HEADER + INLINE)
    summed = _sum(group, block)
    op, count, flags, drop = summed[:_HEADER]
    ids = summed[_HEADER : _HEADER + min(count, INLINE)]
    if count > INLINE:
        ids += _sum(group, tokens[INLINE:] if group.is_driver else [0] * (count - INLINE))
    return Command(Op(op), tuple(ids), bool(flags & NEW_CACHE), bool(flags & RECORD), drop)


def _sum(group: Group, values: list[int]) -> list[int]:
    summed = mx.distributed.all_sum(mx.array(values, dtype=mx.int32), group=group.handle)
    evaluate(summed, what="a control broadcast")
    return summed.tolist()
