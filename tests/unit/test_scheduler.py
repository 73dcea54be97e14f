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
