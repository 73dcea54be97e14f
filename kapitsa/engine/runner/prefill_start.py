"""Where a sequence's prefill starts: a fresh cache, or the prefix cache's deepest state of what it
feeds (the prompt; prompt and output for a row resuming after a failed batch, runner/send_back.py).

A prefill that ran out of memory beside other sequences starts over (`send_back.prepare_restart`):
its new start may find checkpoints its own first attempt wrote, so the request's first figures
stand (when its prefill began, how much of its prompt the cache held), as its client already
read them."""

from __future__ import annotations

import time
from typing import Any

from kapitsa.engine.runner.model_runner import ModelRunner
from kapitsa.engine.runner.sampler import SequenceSampler
from kapitsa.engine.runner.sequence import Sequence


def start(seq: Sequence, prefix: Any, runner: ModelRunner, tail: Any) -> int:
    """Give a sequence that has not begun its prefill (or starts it over) its sampler and cache;
    `tail`: the drafter's prompt tail (prompt_tail.py), or None. Returns the prompt tokens the
    prefix cache served that no earlier attempt counted (the engine's `prompt_cached`)."""
    restart = seq.times_sent_back > 0
    if not restart:
        seq.prefill_started = time.perf_counter()
    seq.sampler = SequenceSampler(
        seq.request.sampling, seq.prompt_ids, eos_ids=seq.eos_ids, constraint=seq.constraint
    )
    match = prefix.lookup(seq.key_ids) if prefix is not None else None
    seq.prompt_tail = tail
    if match is None:
        seq.cache = runner.new_cache()
        return 0
    seq.cache = runner.restore(match, seq.media, room=seq.num_prompt_tokens - match.pos)
    seq.num_processed = match.pos
    seq.pending_logits = match.next_logits if match.pos == seq.num_prompt_tokens else None
    if restart:
        return 0  # counted by its first start, or its own checkpoints
    seq.num_cached_tokens = match.pos
    return match.pos


def resume(seq: Sequence, prefix: Any, runner: ModelRunner) -> None:
    """A sequence sent back from a failed batch: from the prefix cache's deepest state of its
    prompt and output, if any; its sampler, counts and boundaries stay as they were. (Its new
    drafter starts without the prompt's tail, which lines up with a first output token only.)"""
    feed = seq.num_tokens
    match = prefix.lookup(seq.all_key_ids) if prefix is not None else None
    seq.cache = (
        runner.new_cache() if match is None else runner.restore(match, seq.media, room=feed - match.pos)
    )
    if match is not None:
        seq.num_processed = match.pos
        seq.pending_logits = match.next_logits if match.pos == feed else None
