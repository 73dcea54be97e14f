"""Where a sequence leaves prefix-cache checkpoints: message, branch and periodic boundaries in its
prompt, periodic ones in a long generation, and the state at the end of a response."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from kapitsa.engine.runner.sequence import Boundary, Sequence, plan_boundaries

# Fewest tokens from where prefill resumes, or the last boundary kept, to a "branch" or "periodic"
# boundary: with fixed-size state each ends a chunk, a forward worth ~30 chunk tokens on the CPU, for
# a checkpoint that saves a later request at most that many. Message boundaries always stay.
MIN_CHECKPOINT_GAP = 64


def plan_checkpoints(seq: Sequence, prefix: Any, runner: Any, interval: int) -> None:
    """Add a branch boundary where the tree's K/V runs past its checkpoints, and periodic ones
    (`plan_boundaries`: none closer than `MIN_CHECKPOINT_GAP` where chunks end at them)."""
    extra: list[Boundary] = []
    if prefix is not None:
        shared = prefix.match_length(seq.key_ids)
        if seq.num_processed < shared < seq.num_prompt_tokens:
            extra.append(Boundary(shared, "branch"))
    for pos in range((seq.num_processed // interval + 1) * interval, seq.num_prompt_tokens, interval):
        extra.append(Boundary(pos, "periodic"))
    gap = MIN_CHECKPOINT_GAP if runner.recurrent_layers else 1  # else checkpoints cost no chunk
    seq.boundaries = plan_boundaries(
        seq.boundaries, extra, resume=seq.num_processed, end=seq.num_prompt_tokens, min_gap=gap
    )


def insert(prefix, runner, seq: Sequence, tokens, cache, kind: str, logits: mx.array | None = None) -> bool:  # noqa: ANN001
    """`cache`'s state as the checkpoint of `tokens`; whether it was new to the tree."""
    return prefix.insert(
        tokens,
        recurrent=runner.recurrent_state(cache),
        kv_source=lambda a, b: runner.kv_span(cache, a, b),
        conversation=seq.continues_conversation,
        kind=kind,
        next_logits=logits,
    )


def at_boundary(seq: Sequence, pos: int, logits: mx.array | None, prefix: Any, runner: Any) -> None:
    """A prompt checkpoint where a prefill chunk ended on one of the sequence's boundaries."""
    boundary = seq.boundary_at(pos)
    if boundary is None or prefix is None or pos <= seq.num_cached_tokens:
        return
    if insert(prefix, runner, seq, seq.key_ids[:pos], seq.cache, boundary.kind, logits):
        # (one another request made meanwhile is a cache hit, not this one's write)
        seq.num_checkpointed_tokens = max(seq.num_checkpointed_tokens, pos)


def at_end(seq: Sequence, cache: Any, prefix: Any, runner: Any) -> None:
    """Keep the state at the end of a response hot: the agent's next request extends it."""
    if prefix is None or cache is None or seq.finish_reason == "abort":
        return
    pos, tokens = cache.offsets[0], seq.all_key_ids
    if seq.num_cached_tokens < pos <= len(tokens):
        insert(prefix, runner, seq, tokens[:pos], cache, "final")


def in_output(seq: Sequence, row: int, batch: Any, prefix: Any, runner: Any, interval: int) -> None:
    """A periodic checkpoint inside a long generation (a later request may resume mid-way)."""
    if prefix is None or seq.is_finished or batch.cache is None:
        return
    pos = batch.cache.offsets[row]
    if pos // interval <= seq.last_checkpoint_pos // interval or pos > seq.num_tokens:
        return
    seq.last_checkpoint_pos = pos
    insert(prefix, runner, seq, seq.all_key_ids[:pos], batch.extract(row), "periodic")
