"""Rank 0's decision for each step, broadcast to every rank as a small int array.

A command is one `all_sum` of `[op, token count, flags, drop, restore, save, row, forget, leave,
first INLINE token ids]` in which only rank 0 contributes non-zeros, so every rank holds rank 0's values
exactly; a prompt chunk longer than `INLINE` tokens sends the rest in a second one, so a decode
step (or a verify of up to `INLINE` tokens) costs one collective (each is a network round trip:
lab/runs/distributed-cpu.log). Followers block on the next command; rank 0 sends `IDLE` every
`HEARTBEAT_S` while it has nothing to run, so a follower's watchdog can tell an idle group from a
dead one.

Every rank holds two caches (caches.py): the decode batch, one row per decoding request, and the
request being prefilled. Flags: `NEW_CACHE` starts the prefill cache before the forward: empty, or
saved state `restore` (saved.py); `JOIN` moves it into the batch as its last row; `BATCH` runs the
forward on the batch, one token per row (else on the prefill cache); `RECORD` runs it with
`record=True` (a speculative verify of `[last, d1..dk]` on a batch of one: rank 0 gets every
position's logits).

Before that, every rank applies the bookkeeping rank 0 decided after the previous command, in
this order, so none of it costs a collective of its own: `drop`, how many tokens of the previous
forward (a verify) to roll back with `cache.rollback([drop])` (rank 0 learns it from the
acceptance); `save`, an id to keep a cache as it then stands under (a prompt boundary the
previous chunk ended at, the end of a finished request), the prefill cache's (`row` 0) or batch
row `row - 1`'s; `forget`, an id to free (eviction); `leave`, a bit mask of the batch rows that
leave (finished, aborted); then `NEW_CACHE` and `JOIN`. An `IDLE` command carries them as a
`FORWARD` does.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import deque
from dataclasses import dataclass, field

import mlx.core as mx

from kapitsa.engine.distributed.group import Group, evaluate

_HEADER = 9  # op, token count, flags, drop, restore, save, row, forget, leave
INLINE = 8  # token ids that ride in the header
MAX_ROWS = 30  # batch rows `leave` can name (bits of an int32)
NEW_CACHE = 1  # flags bit: start the prefill cache (a new request) before this forward
RECORD = 2  # flags bit: run this forward with replay records and return every position's logits
BATCH = 4  # flags bit: run this forward on the decode batch, one token per row
JOIN = 8  # flags bit: the prefill cache joins the batch as its last row


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
    drop: int = 0  # tokens of the previous forward (on the batch) to roll back before this one
    restore: int = 0  # with new_cache: the saved state the cache starts from (0: empty)
    save: int = 0  # an id to save a cache under, after the drop (0: none)
    row: int = 0  # what `save` keeps: 0 the prefill cache, r + 1 batch row r
    forget: int = 0  # a saved state to free (0: none)
    leave: int = 0  # bit r: batch row r leaves
    batch: bool = False
    join: bool = False

    @property
    def rows(self) -> list[list[int]]:
        """The forward's input rows: one token per batch row, or the tokens of one sequence."""
        return [[t] for t in self.tokens] if self.batch and not self.record else [list(self.tokens)]

    @property
    def paced_as(self) -> int:
        """The token count whose pace (watchdog.StepClock) this forward's deadline follows: a
        verify costs about one decode step, not its tokens' share of a prefill chunk."""
        return 1 if self.record or self.batch else len(self.tokens)

    @property
    def warm_key(self) -> tuple[int, int] | None:
        """The shape this forward compiles for on first use (a verify's width and the rollback
        before it, a batch's row count); None for plain steps of one row."""
        if self.batch and not self.record and len(self.tokens) > 1:
            return (len(self.tokens), -1)
        return (len(self.tokens), self.drop) if self.record or self.drop else None


@dataclass
class Pending:
    """Rank 0's bookkeeping for the next command: every command it sends carries it (`stamp`)."""

    drop: int = 0
    save: int = 0
    row: int = 0
    leave: int = 0
    join: bool = False
    forgets: deque[int] = field(default_factory=deque)  # one rides in each command

    @property
    def any(self) -> bool:
        return bool(self.drop or self.save or self.forgets or self.leave or self.join)

    def save_next(self, state_id: int, row: int = 0) -> None:
        """Save a cache, as the next command finds it, under `state_id` (0: nothing to save): the
        prefill cache (`row` 0) or batch row `row - 1`."""
        assert not self.save, "a save is taken at the command after the forward it follows"
        self.save, self.row = state_id, row

    def stamp(self, command: Command) -> Command:
        forget = self.forgets.popleft() if self.forgets else 0
        stamped = dataclasses.replace(
            command,
            drop=self.drop,
            save=self.save,
            row=self.row,
            forget=forget,
            leave=self.leave,
            join=self.join,
        )
        self.drop = self.save = self.row = self.leave = 0
        self.join = False
        return stamped


def broadcast(group: Group, command: Command | None) -> Command:
    """Rank 0 passes its `command` (others pass None); every rank returns rank 0's command."""
    if group.is_driver:
        assert command is not None
        tokens = list(command.tokens)
        flags = _flags(command)
        ops = [command.drop, command.restore, command.save, command.row, command.forget, command.leave]
        block = [int(command.op), len(tokens), flags, *ops, *tokens[:INLINE]]
        block += [0] * (_HEADER + INLINE - len(block))
    else:
        block = [0] * (_HEADER + INLINE)
    summed = _sum(group, block)
    op, count, flags, drop, restore, save, row, forget, leave = summed[:_HEADER]
    ids = summed[_HEADER : _HEADER + min(count, INLINE)]
    if count > INLINE:
        ids += _sum(group, tokens[INLINE:] if group.is_driver else [0] * (count - INLINE))
    new_cache, record = bool(flags & NEW_CACHE), bool(flags & RECORD)
    batch, join = bool(flags & BATCH), bool(flags & JOIN)
    return Command(
        Op(op), tuple(ids), new_cache, record, drop, restore, save, row, forget, leave, batch, join
    )


def _flags(command: Command) -> int:
    bits = (
        (command.new_cache, NEW_CACHE),
        (command.record, RECORD),
        (command.batch, BATCH),
        (command.join, JOIN),
    )
    return sum(bit for on, bit in bits if on)


def _sum(group: Group, values: list[int]) -> list[int]:
    summed = mx.distributed.all_sum(mx.array(values, dtype=mx.int32), group=group.handle)
    evaluate(summed, what="a control broadcast")
    return summed.tolist()
