"""The rotating K/V cache of a sliding-window attention layer (Flint's `sliding_attention`).

A query at position q sees the keys at positions (q - window, q]. So a row needs only its last
`window` positions: the ring `[B, Hkv, window, D]` holds position p of row b in slot p % window.

Invariant, after every operation: the ring of row b holds exactly its positions
[offsets[b] - window, offsets[b]) (those >= 0; other slots are zeros and masked). Each operation
keeps it exactly, so the window is state like a recurrent layer's, never an approximation:
- a steady decode step writes its one token in place, then attends over the ring;
- any other forward (prefill chunks, ragged rows, verification chains, draft trees) attends over
  `[ring | new tokens]` with a mask built from positions, then rebuilds the ring by one gather;
- a recorded forward keeps the ring from before it and its new K/V (references, no copy), so
  `rollback` rebuilds the ring as if the dropped tokens never came, for any number of them;
- a tree forward leaves the ring alone until `commit_path` writes the kept path as a chain;
- checkpoints, the prefix cache and batching hold or move the ring by rows (see HybridCache).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from kapitsa.engine.cache.layers import StepInfo
from kapitsa.engine.ops import tree


@dataclass(frozen=True)
class WindowRecord:
    """What a recorded or tree forward keeps to rebuild the ring after rollback / commit_path."""

    keys: mx.array  # the ring before the forward
    values: mx.array
    new_keys: mx.array  # [B, Hkv, T, D] the forward's K/V
    new_values: mx.array
    offsets: tuple[int, ...]


class RotatingKVCache:
    """K/V of one sliding-window attention layer (see the module docstring)."""

    def __init__(self, n_kv_heads: int, head_dim: int, window: int):
        if window < 1:
            raise ValueError("a sliding window holds at least one position")
        self.n_kv_heads, self.head_dim, self.window = n_kv_heads, head_dim, window
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.record: WindowRecord | None = None

    def update(
        self, k: mx.array, v: mx.array, info: StepInfo
    ) -> tuple[mx.array, mx.array, mx.array | str | None]:
        """Take `k, v [B, Hkv, T, D]` of this forward; return the keys, values and mask to attend."""
        B = k.shape[0]
        if self.keys is None:
            shape = (B, self.n_kv_heads, self.window, self.head_dim)
            self.keys, self.values = mx.zeros(shape, k.dtype), mx.zeros(shape, v.dtype)
        if info.plain_decode:
            return self._decode_in_place(k, v, info)
        keys = mx.concatenate([self.keys, k], axis=2)
        values = mx.concatenate([self.values, v], axis=2)
        if info.record or info.parents is not None:
            self.record = WindowRecord(self.keys, self.values, k, v, tuple(info.offsets))
        if info.parents is None:  # a tree writes nothing until commit_path
            self.keys, self.values = _rebuilt(keys, values, info.offsets, info.lengths, self.window)
        return keys, values, window_mask(info, self.window)

    def _decode_in_place(self, k: mx.array, v: mx.array, info: StepInfo):
        W = self.window
        if info.uniform_offsets:
            slot = mx.array([info.offsets[0] % W])
            self.keys = mx.slice_update(self.keys, k, slot, (2,))
            self.values = mx.slice_update(self.values, v, slot, (2,))
        else:
            slots = mx.array([o % W for o in info.offsets], dtype=mx.int32)[:, None, None, None]
            self.keys = mx.put_along_axis(self.keys, slots, k, axis=2)
            self.values = mx.put_along_axis(self.values, slots, v, axis=2)
        mask = None
        if min(info.offsets) < W - 1:  # slots past a short row's newest position are empty
            mask = (mx.arange(W)[None, :] <= mx.array(info.offsets)[:, None])[:, None, None, :]
        return self.keys, self.values, mask

    # -- rollback and trees (HybridCache calls these) -----------------------------------------
    def rollback(self, kept: Sequence[int]) -> None:
        """Keep the first `kept[b]` tokens of the latest (recorded) forward."""
        rec = self._take_record()
        keys = mx.concatenate([rec.keys, rec.new_keys], axis=2)
        values = mx.concatenate([rec.values, rec.new_values], axis=2)
        self.keys, self.values = _rebuilt(keys, values, rec.offsets, kept, self.window)

    def commit_path(self, order: mx.array, kept: Sequence[int]) -> None:
        """After a tree forward: write nodes `order[b, :kept[b]]` as the chain that follows."""
        rec = self._take_record()
        index = order[:, None, :, None]
        path_k = mx.take_along_axis(rec.new_keys, index, axis=2)
        path_v = mx.take_along_axis(rec.new_values, index, axis=2)
        keys = mx.concatenate([rec.keys, path_k], axis=2)
        values = mx.concatenate([rec.values, path_v], axis=2)
        self.keys, self.values = _rebuilt(keys, values, rec.offsets, kept, self.window)

    def _take_record(self) -> WindowRecord:
        if self.record is None:
            raise ValueError("the window cache kept no record of the latest forward")
        rec, self.record = self.record, None
        return rec

    # -- batching -----------------------------------------------------------------------------
    def clone_empty(self) -> RotatingKVCache:
        return RotatingKVCache(self.n_kv_heads, self.head_dim, self.window)

    def merge_rows(self, parts: Sequence[RotatingKVCache], sizes: Sequence[int]) -> None:
        """Hold the rows of `parts` (of `sizes[i]` rows each), in order; empty parts become zeros."""
        dtype = next((p.keys.dtype for p in parts if p.keys is not None), None)
        if dtype is None:
            return
        keys, values = [], []
        for p, b in zip(parts, sizes, strict=True):
            shape = (b, self.n_kv_heads, self.window, self.head_dim)
            keys.append(p.keys if p.keys is not None else mx.zeros(shape, dtype))
            values.append(p.values if p.values is not None else mx.zeros(shape, dtype))
        self.keys, self.values = mx.concatenate(keys), mx.concatenate(values)

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    def state_nbytes(self, dtype: mx.Dtype) -> int:
        """Bytes of one sequence's ring in activations of `dtype` (admission control)."""
        return 2 * self.n_kv_heads * self.window * self.head_dim * dtype.size


def _rebuilt(
    keys: mx.array, values: mx.array, offsets: Sequence[int], lengths: Sequence[int], window: int
) -> tuple[mx.array, mx.array]:
    """The ring after row b took `lengths[b]` tokens at `offsets[b]`, gathered from
    `[ring before | new tokens]` (whose column c holds position offsets[b] - window + c)."""
    slots = np.arange(window)
    index = np.empty((len(offsets), window), dtype=np.int32)
    for b, (o, n) in enumerate(zip(offsets, lengths, strict=True)):
        end = o + n
        pos = end - window + (slots - end) % window  # the position slot s holds after the write
        index[b] = np.where(pos >= o, window + pos - o, slots)
    gather = mx.array(index)[:, None, :, None]
    return mx.take_along_axis(keys, gather, axis=2), mx.take_along_axis(values, gather, axis=2)


def window_mask(info: StepInfo, window: int) -> mx.array:
    """`[B or 1, 1, T, window + T]` bool over `[ring | new tokens]`: key position p is visible to
    the query at position q iff 0 <= p, q - window < p, and (new keys) p's token precedes or is q's
    (chains) or is an ancestor-or-self of it (trees). One per forward, shared by the layers."""
    key = ("window", window)
    if key not in info.memo:
        info.memo[key] = _window_mask(info, window)
    return info.memo[key]


def _window_mask(info: StepInfo, window: int) -> mx.array:
    T = info.T
    rows = [0] if info.parents is None and info.uniform_offsets else range(len(info.offsets))
    out = np.zeros((len(rows), 1, T, window + T), dtype=bool)
    for i, b in enumerate(rows):
        o = info.offsets[b]
        if info.parents is None:
            depth, linked = np.arange(T), np.tri(T, dtype=bool)
        else:
            depth, linked = np.array(tree.depths(info.parents[b])), tree.ancestors_or_self(info.parents[b])
        query = o + depth[:, None]  # [T, 1]
        ring = o - window + (np.arange(window) - o) % window  # the position each slot holds
        out[i, 0, :, :window] = (ring >= 0) & (ring > query - window)
        out[i, 0, :, window:] = linked & (o + depth[None, :] > query - window)
    return mx.array(out)


def cacheless_window_mask(info: StepInfo, window: int) -> mx.array | str | None:
    """The window mask of a forward without a cache (every row starts at position 0)."""
    T = info.T
    if window >= T:
        return info.attention_mask
    t = np.arange(T)
    visible = (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - window)
    return mx.array(visible)[None, None]
