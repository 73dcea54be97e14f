"""The choices of an n > 1 request: one prefill, then a fork per further choice."""

from __future__ import annotations

from kapitsa.engine.runner.sampler import SequenceSampler
from kapitsa.engine.runner.sequence import Sequence


def fork_choices(seq: Sequence) -> list[Sequence]:
    """The other choices of `seq`'s request, started where its one prefill ended: each on its own copy
    of the cache (arrays shared until written), with its own sampler and its share of the memory
    reserved for all. Takes them off `seq.forks`; the caller schedules them."""
    forks, seq.forks = seq.forks, []
    share = seq.reserved_bytes // (1 + len(forks))
    for child in forks:
        child.sampler = SequenceSampler(
            child.request.sampling, child.prompt_ids, eos_ids=child.eos_ids, constraint=child.constraint
        )
        child.cache = seq.cache.select([0])
        child.reserved_bytes, seq.reserved_bytes = share, seq.reserved_bytes - share
        child.num_processed, child.num_cached_tokens = seq.num_processed, seq.num_cached_tokens
        child.num_checkpointed_tokens = seq.num_checkpointed_tokens
        child.prefill_started, child.prefill_done_at = seq.prefill_started, seq.prefill_done_at
        child.last_checkpoint_pos = seq.last_checkpoint_pos
        child.prompt_tail = seq.prompt_tail  # read, never written, by each choice's drafter
    return forks
