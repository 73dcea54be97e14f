from __future__ import annotations

import pytest

from kapitsa.engine.runner.scheduler import Scheduler
from kapitsa.engine.runner.sequence import Boundary, Sequence, SequenceStatus
from kapitsa.engine.runner.stop import StopMatcher
from kapitsa.engine.types import GenerationRequest


def _seq(n_prompt: int = 10, boundaries=()) -> Sequence:
    return Sequence(
        request=GenerationRequest(prompt="x"),
        prompt_ids=list(range(n_prompt)),
        emit=lambda e: None,
        sampler=None,
        detokenizer=None,
        stop=StopMatcher(()),
        max_tokens=5,
        boundaries=list(boundaries),
    )


def test_lifecycle_and_rows() -> None:
    sched = Scheduler(max_running=2)
    a, b, c = _seq(), _seq(), _seq()
    for s in (a, b, c):
        sched.add(s)
    sched.admit(a)
    sched.admit(b)
    assert not sched.has_free_slot and a.status is SequenceStatus.PREFILLING
    assert [sched.next_prefill(), sched.next_prefill(), sched.next_prefill()] == [a, b, a]  # round-robin
    assert sched.start_decoding(b) == 0 and sched.start_decoding(a) == 1
    assert sched.find(a.request_id) is a and sched.find("nope") is None
    assert sched.remove(b) == 0 and sched.decoding == [a]
    assert sched.remove(c) is None and not sched.waiting
    assert sched.all() == [a] and sched.has_free_slot


def test_chunks_end_at_checkpoint_boundaries() -> None:
    seq = _seq(100, [Boundary(30, "system"), Boundary(90, "turn")])
    assert seq.next_chunk_end(64) == 30
    seq.num_processed = 30
    assert seq.next_chunk_end(64) == 90
    seq.num_processed = 90
    assert seq.next_chunk_end(64) == 100
    assert seq.boundary_at(90).kind == "turn" and seq.boundary_at(50) is None


def test_max_running_must_be_positive() -> None:
    with pytest.raises(ValueError):
        Scheduler(max_running=0)


def _planned(
    seq: Sequence, *, shared: int, interval: int = 4096, recurrent: bool = True
) -> list[tuple[int, str]]:
    """The boundaries `plan_checkpoints` leaves when the prefix tree holds `shared` tokens
    of the prompt as K/V (a branch boundary there, past the deepest checkpoint)."""
    from types import SimpleNamespace

    from kapitsa.engine.runner.checkpoints import plan_checkpoints

    prefix = SimpleNamespace(match_length=lambda ids: shared)
    runner = SimpleNamespace(recurrent_layers=[0] if recurrent else [])
    plan_checkpoints(seq, prefix, runner, interval)
    return [(b.pos, b.kind) for b in seq.boundaries]


def test_a_branch_boundary_close_to_the_resume_position_is_not_a_chunk_end() -> None:
    from kapitsa.engine.runner.checkpoints import MIN_CHECKPOINT_GAP

    # resumed at 3136 with the tree's K/V 7 tokens further (turn N+1 of an agent conversation)
    seq = _seq(3235, [Boundary(3226, "turn")])
    seq.num_processed = 3136
    assert _planned(seq, shared=3143) == [(3226, "turn")]
    assert seq.next_chunk_end(512) == 3226  # one forward up to the turn, not 7 tokens then 83
    far = _seq(3235, [Boundary(3226, "turn")])
    far.num_processed = 3136
    assert _planned(far, shared=3136 + MIN_CHECKPOINT_GAP) == [(3200, "branch"), (3226, "turn")]
    assert far.next_chunk_end(512) == 3200


def test_periodic_boundaries_keep_the_gap_on_both_sides_and_message_boundaries_stay() -> None:
    seq = _seq(400, [Boundary(10, "system"), Boundary(150, "turn"), Boundary(170, "turn")])
    # periodic every 48: 48 (38 after the system boundary) goes, 96 (54 before the turn at 150)
    # goes, 144 goes, 192 (22 after the turn at 170) goes, 240 stays, 288 goes, 336 (64 before
    # the prompt's end) stays, 384 goes
    assert _planned(seq, shared=0, interval=48) == [
        (10, "system"),
        (150, "turn"),
        (170, "turn"),
        (240, "periodic"),
        (336, "periodic"),
    ]


def test_without_fixed_size_state_every_checkpoint_stays() -> None:
    # attention-only models checkpoint inside a chunk: a close boundary costs no forward
    seq = _seq(3235, [Boundary(3226, "turn")])
    seq.num_processed = 3136
    assert _planned(seq, shared=3143, recurrent=False) == [(3143, "branch"), (3226, "turn")]
    periodic = _seq(400, [Boundary(150, "turn")])
    assert _planned(periodic, shared=0, interval=100, recurrent=False) == [
        (100, "periodic"),
        (150, "turn"),
        (200, "periodic"),
        (300, "periodic"),
    ]
