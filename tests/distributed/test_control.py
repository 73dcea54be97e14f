"""The control header round-trips: what rank 0 broadcasts is what every rank reads back, the
speculative verify's record flag, the previous verify's drop count, the saved-state ids
(restore, save, forget) and the batch's membership (a join, the rows that leave, the row a save
keeps) included; rank 0's pending bookkeeping rides in the next command once."""

from __future__ import annotations

import pytest

pytest.importorskip("mlx.core")

from kapitsa.engine.distributed import control  # noqa: E402 - needs MLX
from kapitsa.engine.distributed.control import INLINE, Command, Op, broadcast  # noqa: E402
from kapitsa.engine.distributed.group import Group  # noqa: E402

COMMANDS = [
    Command(Op.IDLE),
    Command(Op.FORWARD, (5, 6, 7), new_cache=True),
    Command(Op.FORWARD, (9, 1, 2, 3), record=True, drop=0),
    Command(Op.FORWARD, (4,), drop=3),
    Command(Op.FORWARD, tuple(range(1, 2 * INLINE + 3)), record=True, drop=7),
    Command(Op.FORWARD, tuple(range(3, INLINE + 5)), new_cache=True, drop=2, restore=9, save=11, forget=4),
    Command(Op.IDLE, drop=1, save=12, forget=3),
    Command(Op.FORWARD, (4, 5, 6), batch=True, join=True, save=3, row=2, leave=0b101),
    Command(Op.FORWARD, tuple(range(1, INLINE + 4)), batch=True),  # more rows than ride inline
    Command(Op.FORWARD, (1, 2, 3), batch=True, record=True, drop=1),  # a verify of a batch of one
    Command(Op.IDLE, save=4, row=1, leave=1 << (control.MAX_ROWS - 1)),
    Command(Op.STOP),
]


@pytest.mark.parametrize("command", COMMANDS)
def test_a_follower_reads_what_rank_0_sent(command: Command, monkeypatch) -> None:
    """A two-rank sum where the follower contributes zeros: each collective's result is rank 0's block."""
    sent: list[list[int]] = []

    def driver_sum(_group, values):  # noqa: ANN001, ANN202
        sent.append(list(values))
        return list(values)

    monkeypatch.setattr(control, "_sum", driver_sum)
    assert broadcast(Group(0, 2, None), command) == command
    assert len(sent) == (2 if len(command.tokens) > INLINE else 1)  # a decode step is one collective

    def follower_sum(_group, values):  # noqa: ANN001, ANN202
        assert not any(values)  # a follower adds nothing
        return sent.pop(0)

    monkeypatch.setattr(control, "_sum", follower_sum)
    assert broadcast(Group(1, 2, None), None) == command


def test_a_group_of_one_round_trips_through_mlx() -> None:
    import mlx.core as mx

    handle = mx.distributed.init(strict=False)
    command = Command(Op.FORWARD, tuple(range(10, 10 + INLINE + 2)), record=True, drop=4)
    assert broadcast(Group(handle.rank(), handle.size(), handle), command) == command


def test_a_verify_is_paced_as_one_decode_step() -> None:
    assert Command(Op.FORWARD, (1, 2, 3), record=True).paced_as == 1
    assert Command(Op.FORWARD, (1, 2, 3)).paced_as == 3


def test_a_batched_step_feeds_one_token_per_row_at_one_step_s_pace() -> None:
    step = Command(Op.FORWARD, (7, 8, 9), batch=True)
    assert step.rows == [[7], [8], [9]] and step.paced_as == 1 and step.warm_key == (3, -1)
    verify = Command(Op.FORWARD, (7, 8, 9), batch=True, record=True)
    assert verify.rows == [[7, 8, 9]] and verify.warm_key == (3, 0)
    assert Command(Op.FORWARD, (7, 8, 9)).rows == [[7, 8, 9]]  # a prompt chunk
    assert Command(Op.FORWARD, (7,), batch=True).warm_key is None


def test_each_speculative_shape_gets_the_warm_up_deadline_once() -> None:
    """A verify's width and a rollback's length compile on first use: the first of each may take
    as long as a first step; later ones are held to the decode pace."""
    from kapitsa.engine.distributed.watchdog import StepClock

    clock = StepClock(first_s=60, floor_s=3, factor=8)
    clock.record(1, 0.01)
    verify = Command(Op.FORWARD, (1, 2, 3), record=True, drop=1)
    assert clock.deadline(verify.paced_as, verify.warm_key) == 60
    clock.record(verify.paced_as, 0.02, verify.warm_key)
    assert clock.deadline(verify.paced_as, verify.warm_key) == 3
    assert Command(Op.FORWARD, (4,)).warm_key is None  # a plain step has no shape of its own


def test_pending_bookkeeping_rides_in_the_next_command_once() -> None:
    from kapitsa.engine.distributed.control import Pending

    pending = Pending(drop=2)
    pending.save_next(5)
    pending.forgets.extend([7, 8])
    first = pending.stamp(Command(Op.FORWARD, (1,), new_cache=True, restore=3))
    assert (first.drop, first.save, first.forget, first.restore, first.new_cache) == (2, 5, 7, 3, True)
    second = pending.stamp(Command(Op.IDLE))
    assert (second.drop, second.save, second.forget) == (0, 0, 8)
    assert not pending.any
    pending.save_next(6, row=2)
    pending.leave, pending.join = 0b10, True
    third = pending.stamp(Command(Op.FORWARD, (1, 2), batch=True))
    assert (third.save, third.row, third.leave, third.join) == (6, 2, 0b10, True)
    assert not pending.any and pending.stamp(Command(Op.IDLE)) == Command(Op.IDLE)
