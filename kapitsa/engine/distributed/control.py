"""Rank 0's decision for each step, broadcast to every rank as a small int array.

A command is one `all_sum` of `[op, token count, flags, drop, restore, save, forget, first INLINE
token ids]` in which only rank 0 contributes non-zeros, so every rank holds rank 0's values
exactly; a prompt chunk longer than `INLINE` tokens sends the rest in a second one, so a decode
step (or a verify of up to `INLINE` tokens) costs one collective (each is a network round trip:
lab/runs/distributed-cpu.log). Followers block on the next command; rank 0 sends `IDLE` every
`HEARTBEAT_S` while it has nothing to run, so a follower's watchdog can tell an idle group from a
dead one.

Flags: `NEW_CACHE` starts this request's cache before the forward: empty, or saved state
`restore` (saved.py); `RECORD` runs it with `record=True` (a speculative verify of `[last, d1..dk]`:
rank 0 gets every position's logits).

Before that, every rank applies the bookkeeping rank 0 decided after the previous command, in
this order, so none of it costs a collective of its own: `drop`, how many tokens of the previous
forward (a verify) to roll back with `cache.rollback([drop])` (rank 0 learns it from the
acceptance); `save`, an id to keep the cache as it then stands under (a prompt boundary the
previous chunk ended at, the end of a finished request); `forget`, an id to free (eviction). An
`IDLE` command carries them as a `FORWARD` does.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import deque
from dataclasses import dataclass, field

import mlx.core as mx

from kapitsa.engine.distributed.group import Group, evaluate

_HEADER = 7  # op, token count, flags, drop, restore, save, forget
INLINE = 8  # token ids that ride in the header
NEW_CACHE = 1  # flags bit: start the cache (a new request) before this forward
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
    restore: int = 0  # with new_cache: the saved state the cache starts from (0: empty)
    save: int = 0  # an id to save the cache under, after the drop (0: none)
    forget: int = 0  # a saved state to free (0: none)

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


@dataclass
class Pending:
    """Rank 0's bookkeeping for the next command: every command it sends carries it (`stamp`)."""

    drop: int = 0
    save: int = 0
    forgets: deque[int] = field(default_factory=deque)  # one rides in each command

    @property
    def any(self) -> bool:
        return bool(self.drop or self.save or self.forgets)

    def save_next(self, state_id: int) -> None:
        """Save the cache, as the next command finds it, under `state_id` (0: nothing to save)."""
        assert not self.save, "a save is taken at the command after the forward it follows"
        self.save = state_id

    def stamp(self, command: Command) -> Command:
        forget = self.forgets.popleft() if self.forgets else 0
        stamped = dataclasses.replace(command, drop=self.drop, save=self.save, forget=forget)
        self.drop = self.save = 0
        return stamped


def broadcast(group: Group, command: Command | None) -> Command:
    """Rank 0 passes its `command` (others pass None); every rank returns rank 0's command."""
    if group.is_driver:
        assert command is not None
        tokens = list(command.tokens)
        flags = (NEW_CACHE if command.new_cache else 0) | (RECORD if command.record else 0)
        ops = [command.drop, command.restore, command.save, command.forget]
        block = [int(command.op), len(tokens), flags, *ops, *tokens[:INLINE]]
        block += [0] * (_HEADER + INLINE - len(block))
    else:
        block = [0] * (_HEADER + INLINE)
    summed = _sum(group, block)
    op, count, flags, drop, restore, save, forget = summed[:_HEADER]
    ids = summed[_HEADER : _HEADER + min(count, INLINE)]
    if count > INLINE:
        ids += _sum(group, tokens[INLINE:] if group.is_driver else [0] * (count - INLINE))
    new_cache, record = bool(flags & NEW_CACHE), bool(flags & RECORD)
    return Command(Op(op), tuple(ids), new_cache, record, drop, restore, save, forget)


def _sum(group: Group, values: list[int]) -> list[int]:
    summed = mx.distributed.all_sum(mx.array(values, dtype=mx.int32), group=group.handle)
    evaluate(summed, what="a control broadcast")
    return summed.tolist()
