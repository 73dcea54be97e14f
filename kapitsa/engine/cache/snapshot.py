"""A batch-1 cache's state as arrays, and a fresh cache filled from them.

Attention K/V is taken as a span of positions (`kv_span`, views: the caller detaches what it keeps);
fixed-size state (recurrent layers' conv rows and state, sliding windows' keys and values) whole and
by reference, since each update replaces those arrays rather than writing into them. The engine's
prefix cache (runner/model_runner.py) and a group's saved states (distributed/saved.py) both go
through these, each over the layers its cache holds.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import mlx.core as mx

from kapitsa.engine.cache.hybrid import HybridCache
from kapitsa.engine.cache.layers import KVCache, RecurrentCache, _round_up
from kapitsa.engine.cache.quantized_kv import slot_count
from kapitsa.engine.cache.window import RotatingKVCache

FIXED_STATE = (RecurrentCache, RotatingKVCache)
KV_AXIS = 2  # token axis of KV buffers


def kv_layer_ids(cache: HybridCache) -> list[int]:
    """The cache's attention layers (K/V that grows with the tokens)."""
    return [i for i, c in enumerate(cache.layers) if isinstance(c, KVCache)]


def fixed_layer_ids(cache: HybridCache) -> list[int]:
    """The cache's layers whose state keeps one size: recurrent layers and sliding windows."""
    return [i for i, c in enumerate(cache.layers) if isinstance(c, FIXED_STATE)]


def kv_span(cache: HybridCache, layer_ids: Iterable[int], start: int, end: int) -> tuple[mx.array, ...]:
    """Every array of the attention layers `layer_ids` at positions [start, end) (row 0 only)."""
    out: list[mx.array] = []
    for i in layer_ids:
        layer = cache.layers[i]
        assert isinstance(layer, KVCache) and layer.keys is not None and layer.values is not None
        out += [a[:, :, start:end] for a in layer.slots()]
    return tuple(out)


def fixed_state(cache: HybridCache, layer_ids: Iterable[int]) -> tuple[mx.array, ...]:
    """(conv, state) of each recurrent layer and (keys, values) of each sliding window, by reference."""
    out: list[mx.array] = []
    for i in layer_ids:
        out += layer_state(cache.layers[i])
    return tuple(out)


def layer_state(layer: RecurrentCache | RotatingKVCache) -> tuple[mx.array, mx.array]:
    pair = (layer.keys, layer.values) if isinstance(layer, RotatingKVCache) else (layer.conv, layer.state)
    assert pair[0] is not None and pair[1] is not None
    return pair


def fill(
    cache: HybridCache,
    *,
    pos: int,
    kv: Iterable[mx.array | Sequence[mx.array]],
    fixed: Iterable[mx.array],
    kv_layers: Iterable[int],
    fixed_layers: Iterable[int],
    room: int = 0,
) -> None:
    """Make an empty batch-1 `cache` hold `pos` tokens: `kv` ([0, pos) per array, in `kv_span`'s
    order; an array, or its consecutive spans along the token axis) set as its K/V, `fixed` (in
    `fixed_state`'s order) as its fixed-size state. `room`: tokens still to come; with room the
    K/V buffers are made `pos + room` rounded up to the cache's growth step, so the next forwards
    write into them rather than grow them (`KVCache._reserve`: another copy of all K/V)."""
    capacity = _round_up(pos + room) if room > 0 else pos
    kv_arrays = iter(kv)
    for i in kv_layers:
        layer = cache.layers[i]
        assert isinstance(layer, KVCache)
        layer.set_slots([with_capacity(next(kv_arrays), capacity) for _ in range(slot_count(layer))])
    fixed_arrays = iter(fixed)
    for i in fixed_layers:
        layer = cache.layers[i]
        if isinstance(layer, RotatingKVCache):
            layer.keys, layer.values = next(fixed_arrays), next(fixed_arrays)
        else:
            layer.conv, layer.state = next(fixed_arrays), next(fixed_arrays)
    cache.offsets = [pos]


def with_capacity(spans: mx.array | Sequence[mx.array], capacity: int) -> mx.array:
    """The spans joined along the token axis, zero-padded (as `KVCache._reserve` pads: scratch past
    the offset) to `capacity` positions: one copy, or none for a single span that fits exactly."""
    parts = [spans] if isinstance(spans, mx.array) else list(spans)
    have = sum(p.shape[KV_AXIS] for p in parts)
    if capacity > have:
        shape = list(parts[0].shape)
        shape[KV_AXIS] = capacity - have
        parts.append(mx.zeros(shape, parts[0].dtype))
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=KV_AXIS)
