"""Rollback of a speculative verify as one compiled call.

A rollback replays each recurrent layer's recurrence over the kept tokens from the state saved
before the verify, and takes the conv rows at the new end. Op by op that is several graph
operations per layer, built in Python after every verify, which on a host-bound GPU backend is a
real share of a speculative step (docs/results.md has the verify and rollback costs). When every
layer's record has a pure form (`ReplayRecord.fn`, made by the compiled chain paths), the whole
rollback is one `mx.compile`d function of (mask, conv start per row, every layer's inputs), traced
once per verify length and batch size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import mlx.core as mx

from kapitsa.engine.traces import compiled

if TYPE_CHECKING:
    from kapitsa.engine.cache.layers import RecurrentCache


def conv_rows_at(conv_in: mx.array, starts: mx.array, kernel: int) -> mx.array:
    """Rows `starts[b] .. starts[b] + kernel - 2` of conv_in [B, K-1+T, C] (what `conv_state_after`
    keeps, with the start as an array so one trace serves every accept length)."""
    rows = starts[:, None] + mx.arange(kernel - 1)
    return mx.take_along_axis(conv_in, rows[..., None], axis=1)


def _rollback_fn(fns: Sequence[Callable], layout: tuple[tuple[int, int], ...]) -> Callable:
    def run(mask: mx.array, starts: mx.array, *flat: mx.array) -> list[mx.array]:
        out, i = [], 0
        for fn, (n_args, kernel) in zip(fns, layout, strict=True):
            args = flat[i : i + n_args]
            i += n_args
            out += [conv_rows_at(args[0], starts, kernel), fn(mask, *args)]
        return out

    return run


def replay_compiled(layers: Sequence[RecurrentCache], mask: mx.array, kept: Sequence[int]) -> None:
    """Roll every layer back to its first `kept[b]` verified tokens (each `layer.record.fn` set)
    and clear the records."""
    records = [layer.record for layer in layers]
    layout = tuple((len(r.args), r.kernel) for r in records)
    fns = [r.fn for r in records]
    owner = getattr(fns[0], "__self__", None)
    if owner is None:
        raise TypeError("ReplayRecord.fn must be a bound method of the layer's mixer")
    run = compiled(owner, ("rollback", len(layers), layout), _rollback_fn(fns, layout))
    flat = [a for r in records for a in r.args]
    out = run(mask, mx.array(list(kept), dtype=mx.int32), *flat)
    for j, layer in enumerate(layers):
        layer.conv, layer.state, layer.record = out[2 * j], out[2 * j + 1], None
