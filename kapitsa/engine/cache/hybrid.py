"""Per-sequence model state for hybrid models, batched, with checkpoints and replay rollback.

A `HybridCache` holds one entry per model layer: `KVCache` for attention layers,
`RecurrentCache` (conv rows + float32 recurrent state) for GDN / Mamba-2 layers, `None` for
stateless layers (MLP, MoE). Row b of every array belongs to sequence b of the batch.

Batches are ragged and right-padded: a forward over `inputs [B, T]` with `lengths[b] <= T`
consumes only the first `lengths[b]` tokens of row b. Attention writes K/V at each sequence's own
offset (`offsets[b] + t`) and masks keys beyond it; recurrent layers freeze the state on padded
steps and take the conv rows at each sequence's end, so every sequence ends exactly where it would
have ended alone. `offsets[b]` (tokens held) is shared by all layers.

Speculative decoding rolls back by replay (hybrid-engine.md §5.2): a forward with
`record=True` keeps, per recurrent layer, the state before the pass and the per-token kernel
inputs; `rollback(n)` then drops the last `n[b]` tokens: attention just lowers the offset (the
slots become scratch), recurrent layers re-run only their recurrence over the kept prefix from the
saved state. MLX arrays are immutable, so `checkpoint()` is a set of references, not a copy.
A draft tree (`model(..., parents=...)`, ops/tree.py) holds nothing until `commit_path(paths)`
keeps one root path per row: its K/V rows move to `offsets[b] + j`, recurrent layers replay it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from kapitsa.engine.cache.layers import KVCache, LayerCache, RecurrentCache, StepInfo, _round_up
from kapitsa.engine.cache.replay import replay_compiled
from kapitsa.engine.cache.window import RotatingKVCache
from kapitsa.engine.ops import tree
from kapitsa.engine.ops.conv import conv_state_after


@dataclass(frozen=True)
class CacheCheckpoint:
    """Recurrent state of every layer plus the offsets, by reference (no copy).

    Restoring is exact as long as the KV slots below these offsets were not rewritten since, i.e.
    the cache was not rolled back below the checkpoint and then advanced (KV slots below an offset
    are never written otherwise)."""

    offsets: tuple[int, ...]
    recurrent: tuple[tuple[mx.array | None, mx.array | None] | None, ...]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for pair in self.recurrent if pair for a in pair if a is not None)


class HybridCache:
    """All layers' state for a batch of sequences. Build it with `model.make_cache(batch_size)`.

    Lifecycle of one forward (the model does this): `info = cache.begin(T, lengths, record)`,
    layers read/write their entry, `cache.end(info)` advances `offsets[b] += lengths[b]`.
    """

    def __init__(self, layers: Sequence[LayerCache], batch_size: int = 1):
        self.layers: list[LayerCache] = list(layers)
        self.offsets: list[int] = [0] * batch_size
        # per row: rope position minus cache position after the prompt (vision prompts; see StepInfo)
        self.rope_deltas: list[int] = [0] * batch_size
        self._last: StepInfo | None = None  # the latest forward, for rollback

    def __getitem__(self, i: int) -> LayerCache:
        return self.layers[i]

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def batch_size(self) -> int:
        return len(self.offsets)

    # -- forward protocol -------------------------------------------------------------------
    def begin(
        self,
        T: int,
        lengths: Sequence[int] | None = None,
        record: bool = False,
        parents: Sequence[Sequence[int]] | None = None,
    ) -> StepInfo:
        lengths = list(lengths) if lengths is not None else [T] * self.batch_size
        if len(lengths) != self.batch_size or any(not 0 <= n <= T for n in lengths):
            raise ValueError(f"lengths {lengths} do not fit a batch of {self.batch_size} rows of {T} tokens")
        rows = None if parents is None else tree.validate_parents(parents, self.batch_size, T)
        for layer in [*self._recurrent(), *self._windowed()]:
            layer.record = None  # a new forward invalidates the previous pass's replay records
        deltas = list(self.rope_deltas) if any(self.rope_deltas) else None
        return StepInfo(T, lengths, list(self.offsets), record or rows is not None, rows, deltas)

    def end(self, info: StepInfo) -> None:
        if info.parents is None:  # a tree forward holds nothing until `commit_path`
            self.offsets = [o + n for o, n in zip(info.offsets, info.lengths, strict=True)]
        self._last = info

    # -- speculative decoding ---------------------------------------------------------------
    def rollback(self, n: int | Sequence[int]) -> None:
        """Forget the last `n[b]` tokens of the latest forward (which must have been recorded
        unless every n[b] is 0). Afterwards the cache equals one that never saw them."""
        drop = [n] * self.batch_size if isinstance(n, int) else list(n)
        info = self._last
        if not any(drop):
            return self.commit()
        if info is None:
            raise ValueError("nothing to roll back: rollback undoes the latest forward only")
        if not info.record and (self._recurrent() or self._windowed()):  # full attention (MTP) needs none
            raise ValueError("rollback needs the previous forward to run with record=True")
        if info.parents is not None:
            raise ValueError("a tree forward is resolved with commit_path, not rollback")
        if len(drop) != self.batch_size or any(
            not 0 <= d <= k for d, k in zip(drop, info.lengths, strict=True)
        ):
            raise ValueError(f"cannot drop {drop} tokens from a forward that consumed {info.lengths}")
        kept = [k - d for k, d in zip(info.lengths, drop, strict=True)]
        mask = mx.arange(info.T)[None, :] < mx.array(kept)[:, None]
        layers = self._recurrent()
        if layers and all(layer.record.fn is not None for layer in layers):
            replay_compiled(layers, mask, kept)
        else:
            for layer in layers:
                rec = layer.record
                layer.conv = conv_state_after(rec.conv_in, kept, rec.kernel)
                layer.state = rec.replay(mask)
                layer.record = None
        for layer in self._windowed():
            layer.rollback(kept)
        self.offsets = [o - d for o, d in zip(self.offsets, drop, strict=True)]
        self._last = None

    def commit_path(self, paths: Sequence[Sequence[int]]) -> None:
        """After a tree forward: keep, per row, the nodes of `paths[b]` (root first, each the child
        of the previous; [] keeps nothing). Afterwards the cache equals one that decoded exactly
        those tokens as a chain."""
        info = self._last
        if info is None or info.parents is None:
            raise ValueError("commit_path needs the previous forward to be a tree forward")
        rows = [list(p) for p in paths]
        if len(rows) != self.batch_size or any(
            p and (p[0] != 0 or p[-1] >= n or any(par[c] != a for a, c in zip(p, p[1:], strict=False)))
            for p, par, n in zip(rows, info.parents, info.lengths, strict=True)
        ):
            raise ValueError(f"{rows} are not root-first paths of the verified trees")
        P = max(1, max(map(len, rows)))
        kept = [len(p) for p in rows]
        order = mx.array([p + [p[-1] if p else 0] * (P - len(p)) for p in rows], dtype=mx.int32)
        offsets = mx.array(info.offsets, dtype=mx.int32)[:, None]
        src, dst = (offsets + order)[:, None, :, None], (offsets + mx.arange(P))[:, None, :, None]
        for layer in self.layers:
            if isinstance(layer, KVCache) and layer.keys is not None:
                layer.set_slots(
                    [
                        mx.put_along_axis(a, dst, mx.take_along_axis(a, src, axis=2), axis=2)
                        for a in layer.slots()
                    ]
                )
        mask = mx.arange(P)[None, :] < mx.array(kept)[:, None]
        for layer in self._recurrent():
            rec, K = layer.record, layer.record.kernel
            conv_in = mx.concatenate(
                [rec.conv_in[:, : K - 1], tree.gather_time(rec.conv_in[:, K - 1 :], order)], 1
            )
            layer.conv = conv_state_after(conv_in, kept, K)
            layer.state = rec.replay(mask, order)
            layer.record = None
        for layer in self._windowed():
            layer.commit_path(order, kept)
        self.offsets = [o + k for o, k in zip(info.offsets, kept, strict=True)]
        self._last = None

    def commit(self) -> None:
        """Keep everything the latest forward consumed and free its replay records."""
        for layer in [*self._recurrent(), *self._windowed()]:
            layer.record = None
        self._last = None

    # -- checkpoints ------------------------------------------------------------------------
    def checkpoint(self) -> CacheCheckpoint:
        rec = tuple(_state_pair(c) for c in self.layers)
        return CacheCheckpoint(tuple(self.offsets), rec)

    def restore(self, ckpt: CacheCheckpoint) -> None:
        if len(ckpt.offsets) != self.batch_size or len(ckpt.recurrent) != len(self.layers):
            raise ValueError("checkpoint belongs to a cache of another shape")
        for layer, pair in zip(self.layers, ckpt.recurrent, strict=True):
            if isinstance(layer, RecurrentCache):
                layer.conv, layer.state = pair
                layer.record = None
            elif isinstance(layer, RotatingKVCache):  # the window is state: restored by reference
                layer.keys, layer.values = pair
                layer.record = None
        self.offsets = list(ckpt.offsets)
        self._last = None

    # -- continuous batching ----------------------------------------------------------------
    def extract(self, i: int) -> HybridCache:
        """Sequence i alone (a new cache; KV trimmed to its length)."""
        return self.select([i])

    def select(self, rows: Sequence[int]) -> HybridCache:
        """A new cache holding the given rows, in that order."""
        idx = mx.array(list(rows), dtype=mx.int32)
        out = HybridCache([_clone_empty(c) for c in self.layers], len(rows))
        out.offsets = [self.offsets[r] for r in rows]
        out.rope_deltas = [self.rope_deltas[r] for r in rows]
        keep = _round_up(max(out.offsets, default=0))
        for src, dst in zip(self.layers, out.layers, strict=True):
            if isinstance(src, KVCache) and src.keys is not None:
                dst.set_slots([a[idx, :, :keep] for a in src.slots()])
            elif isinstance(src, RecurrentCache):
                dst.conv = None if src.conv is None else src.conv[idx]
                dst.state = None if src.state is None else src.state[idx]
            elif isinstance(src, RotatingKVCache) and src.keys is not None:
                dst.keys, dst.values = src.keys[idx], src.values[idx]
        return out

    def filter(self, rows: Sequence[int]) -> None:
        """Keep only the given rows (sequences leaving the batch), in place."""
        kept = self.select(rows)
        self.layers, self.offsets, self._last = kept.layers, kept.offsets, None
        self.rope_deltas = kept.rope_deltas

    def extend(self, other: HybridCache) -> None:
        """Append other's sequences to this batch, in place."""
        merged = HybridCache.merge([self, other])
        self.layers, self.offsets, self._last = merged.layers, merged.offsets, None
        self.rope_deltas = merged.rope_deltas

    @staticmethod
    def merge(caches: Sequence[HybridCache]) -> HybridCache:
        """One batch made of all rows of `caches`, in order (same model required)."""
        if not caches or len({len(c.layers) for c in caches}) != 1:
            raise ValueError("merge needs caches of the same model")
        out = HybridCache([_clone_empty(c) for c in caches[0].layers], sum(c.batch_size for c in caches))
        out.offsets = [o for c in caches for o in c.offsets]
        out.rope_deltas = [d for c in caches for d in c.rope_deltas]
        for i, dst in enumerate(out.layers):
            parts = [c.layers[i] for c in caches]
            if isinstance(dst, KVCache):
                _merge_kv(dst, parts, [c.batch_size for c in caches], _round_up(max(out.offsets, default=0)))
            elif isinstance(dst, RecurrentCache):
                _merge_recurrent(dst, parts, [c.batch_size for c in caches])
            elif isinstance(dst, RotatingKVCache):
                dst.merge_rows(parts, [c.batch_size for c in caches])
        return out

    # -- memory -----------------------------------------------------------------------------
    def _recurrent(self) -> list[RecurrentCache]:
        return [c for c in self.layers if isinstance(c, RecurrentCache)]

    def _windowed(self) -> list[RotatingKVCache]:
        return [c for c in self.layers if isinstance(c, RotatingKVCache)]

    @property
    def kv_nbytes(self) -> int:
        return sum(c.nbytes for c in self.layers if isinstance(c, KVCache))

    @property
    def recurrent_nbytes(self) -> int:
        """Fixed-size state per sequence: recurrent layers and sliding windows."""
        return sum(c.nbytes for c in [*self._recurrent(), *self._windowed()])

    @property
    def nbytes(self) -> int:
        return self.kv_nbytes + self.recurrent_nbytes

    def state_arrays(self) -> list[mx.array]:
        """Every array the cache holds (for `mx.eval`)."""
        out: list[mx.array] = []
        for c in self.layers:
            if isinstance(c, KVCache):
                out += c.eval_arrays()  # as held: reading `keys` would fold a decode tail
            elif isinstance(c, RecurrentCache):
                out += [a for a in (c.conv, c.state) if a is not None]
            elif isinstance(c, RotatingKVCache) and c.keys is not None:
                out += [c.keys, c.values]
        return out


def _state_pair(c: LayerCache) -> tuple[mx.array | None, mx.array | None] | None:
    if isinstance(c, RecurrentCache):
        return c.conv, c.state
    if isinstance(c, RotatingKVCache):
        return c.keys, c.values
    return None


def _clone_empty(c: LayerCache) -> LayerCache:
    if isinstance(c, RotatingKVCache):
        return c.clone_empty()
    if isinstance(c, KVCache):
        return c.empty_like()
    if isinstance(c, RecurrentCache):
        return RecurrentCache(c.conv_shape, c.state_shape)
    return None


def _merge_kv(dst: KVCache, parts: list[KVCache], sizes: list[int], capacity: int) -> None:
    like = next((p.slots() for p in parts if p.keys is not None), ())
    if not like or capacity == 0:
        return
    merged: list[list[mx.array]] = [[] for _ in like]
    for p, b in zip(parts, sizes, strict=True):
        for j, (ref, a) in enumerate(zip(like, p.slots() or [None] * len(like), strict=True)):
            if a is None:  # a row that holds nothing yet: zeros of every slot's shape
                merged[j].append(mx.zeros((b, ref.shape[1], capacity, *ref.shape[3:]), ref.dtype))
                continue
            have = min(a.shape[2], capacity)
            merged[j].append(mx.pad(a[:, :, :have], [(0, 0), (0, 0), (0, capacity - have), (0, 0)]))
    dst.set_slots([mx.concatenate(m) for m in merged])


def _merge_recurrent(dst: RecurrentCache, parts: list[RecurrentCache], sizes: list[int]) -> None:
    dtype = next((p.conv.dtype for p in parts if p.conv is not None), None)
    if dtype is None:
        return
    convs, states = [], []
    for p, b in zip(parts, sizes, strict=True):
        zc, zs = dst.zeros(b, dtype) if p.conv is None or p.state is None else (None, None)
        convs.append(p.conv if p.conv is not None else zc)
        states.append(p.state if p.state is not None else zs)
    dst.conv, dst.state = mx.concatenate(convs), mx.concatenate(states)
