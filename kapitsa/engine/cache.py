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

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import mlx.core as mx

from kapitsa.engine.ops import tree
from kapitsa.engine.ops.conv import conv_state_after
from kapitsa.engine.replay import replay_compiled

KV_STEP = 256  # KV buffers grow in multiples of this many positions


@dataclass
class StepInfo:
    """What the layers of one forward need to know about the batch (built by `HybridCache.begin`)."""

    T: int
    lengths: list[int]  # tokens consumed per row (<= T)
    offsets: list[int]  # tokens already held per row before this forward
    record: bool = False  # keep replay records for `rollback`
    parents: list[list[int]] | None = None  # draft tree per row (see ops/tree.py); None = chains
    _windows: dict[int, mx.array] = field(default_factory=dict, repr=False)

    @property
    def ragged(self) -> bool:
        return any(n != self.T for n in self.lengths)

    @cached_property  # asked by every layer of a forward
    def plain_decode(self) -> bool:
        """One token per row, no padding, no tree, no replay record: the steady decode step."""
        return self.T == 1 and not self.record and self.parents is None and not self.ragged

    @cached_property
    def offsets_array(self) -> mx.array:
        """`[B]` int32 offsets (rope positions), one array per forward for every layer."""
        return mx.array(self.offsets, dtype=mx.int32)

    @property
    def uniform_offsets(self) -> bool:
        return len(set(self.offsets)) <= 1

    @cached_property
    def recurrent_mask(self) -> mx.array | None:
        """`[B, T]` bool, True on real tokens; None when no row is padded."""
        if not self.ragged:
            return None
        return mx.arange(self.T)[None, :] < mx.array(self.lengths)[:, None]

    @property
    def kept(self) -> list[int] | None:
        """Per-row token counts for conv-state gathering; None when every row used all T."""
        return list(self.lengths) if self.ragged else None

    @property
    def rope_offsets(self) -> int | mx.array:
        return self.offsets[0] if self.uniform_offsets else mx.array(self.offsets, dtype=mx.int32)

    def conv_windows(self, kernel: int) -> mx.array:
        """`[B, T, K]` conv rows of each tree node (computed once per kernel size)."""
        if kernel not in self._windows:
            self._windows[kernel] = tree.conv_windows(self.parents, kernel)
        return self._windows[kernel]

    @cached_property
    def tree_positions(self) -> mx.array:
        """`[B, T]` per-node positions of a tree forward (offset + depth)."""
        return tree.tree_positions(self.parents, self.offsets)

    @property
    def kv_len(self) -> int:
        return max(self.offsets) + self.T

    @cached_property
    def attention_mask(self) -> mx.array | str | None:
        """Key position p is visible to query t of row b iff p <= offsets[b] + t (chains), or
        p < offsets[b] or node p - offsets[b] is an ancestor-or-self of t (trees)."""
        if self.parents is not None:
            return tree.tree_attention_mask(self.parents, self.offsets, self.kv_len)
        if self.uniform_offsets:
            return "causal" if self.T > 1 else None
        limit = mx.array(self.offsets)[:, None] + mx.arange(self.T)[None, :]  # [B, T]
        return (mx.arange(self.kv_len)[None, None, :] <= limit[..., None])[:, None]  # [B,1,T,L]


def full_step(batch: int, T: int, lengths: Sequence[int] | None = None) -> StepInfo:
    """StepInfo of a cache-less forward (all sequences start at position 0)."""
    return StepInfo(T, list(lengths) if lengths is not None else [T] * batch, [0] * batch)


class KVCache:
    """K/V of one attention layer: `[B, Hkv, capacity, D]`, positions >= offsets[b] are scratch."""

    def __init__(self, n_kv_heads: int, head_dim: int):
        self.n_kv_heads, self.head_dim = n_kv_heads, head_dim
        self.keys: mx.array | None = None
        self.values: mx.array | None = None

    def update(self, k: mx.array, v: mx.array, info: StepInfo) -> tuple[mx.array, mx.array]:
        """Write `k, v [B, Hkv, T, D]` at each row's offset; return the keys/values to attend."""
        B, _, T, _ = k.shape
        self._reserve(B, info.kv_len, k.dtype)
        if info.uniform_offsets:
            start = info.offsets[0]
            self.keys = mx.slice_update(self.keys, k, mx.array([start]), (2,))
            self.values = mx.slice_update(self.values, v, mx.array([start]), (2,))
        else:
            pos = (mx.array(info.offsets)[:, None] + mx.arange(T))[:, None, :, None]
            self.keys = mx.put_along_axis(self.keys, pos, k, axis=2)
            self.values = mx.put_along_axis(self.values, pos, v, axis=2)
        return self.keys[:, :, : info.kv_len], self.values[:, :, : info.kv_len]

    def _reserve(self, batch: int, needed: int, dtype: mx.Dtype) -> None:
        have = 0 if self.keys is None else self.keys.shape[2]
        if needed <= have:
            return
        grow = -(-(needed - have) // KV_STEP) * KV_STEP
        shape = (batch, self.n_kv_heads, grow, self.head_dim)
        pad_k, pad_v = mx.zeros(shape, dtype), mx.zeros(shape, dtype)
        if self.keys is None:
            self.keys, self.values = pad_k, pad_v
        else:
            self.keys = mx.concatenate([self.keys, pad_k], axis=2)
            self.values = mx.concatenate([self.values, pad_v], axis=2)

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


@dataclass
class ReplayRecord:
    """Kept by a recurrent layer during a recorded forward (see module docstring)."""

    conv_in: mx.array  # [B, K-1+T, C]: conv rows before the pass + the new pre-conv rows
    kernel: int  # conv kernel size K
    # (mask [B, P], order [B, P] | None) -> state after the masked steps, taking the forward's
    # per-token inputs in `order` (node indices of a tree path; None: as they were, a chain)
    replay: Callable[..., mx.array]
    # The same replay of a chain as a pure function, `fn(mask, *args)`, args[0] being conv_in:
    # a rollback whose layers all have one runs as one compiled call (replay.py). `fn` is a
    # bound method of the layer's mixer (stable: the compiled trace is kept on that module).
    fn: Callable[..., mx.array] | None = None
    args: tuple[mx.array, ...] = ()


@dataclass
class RecurrentCache:
    """Conv rows `[B, K-1, C]` (activation dtype) and recurrent state (float32) of one layer.

    `state_shape` is the per-sequence state shape ([Hv, Dv, Dk] for GDN, [H, P, N] for Mamba-2);
    None arrays mean "zeros" (a sequence that has seen no tokens).
    """

    conv_shape: tuple[int, int]
    state_shape: tuple[int, ...]
    conv: mx.array | None = None
    state: mx.array | None = None
    record: ReplayRecord | None = field(default=None, repr=False)

    def zeros(self, batch: int, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        return (mx.zeros((batch, *self.conv_shape), dtype), mx.zeros((batch, *self.state_shape), mx.float32))

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.conv, self.state) if a is not None)


LayerCache = KVCache | RecurrentCache | None


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
        for layer in self._recurrent():
            layer.record = None  # a new forward invalidates the previous pass's replay records
        return StepInfo(T, lengths, list(self.offsets), record or rows is not None, rows)

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
        if not info.record and self._recurrent():  # attention-only caches (MTP) need no record
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
                layer.keys = mx.put_along_axis(
                    layer.keys, dst, mx.take_along_axis(layer.keys, src, axis=2), axis=2
                )
                layer.values = mx.put_along_axis(
                    layer.values, dst, mx.take_along_axis(layer.values, src, axis=2), axis=2
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
        self.offsets = [o + k for o, k in zip(info.offsets, kept, strict=True)]
        self._last = None

    def commit(self) -> None:
        """Keep everything the latest forward consumed and free its replay records."""
        for layer in self._recurrent():
            layer.record = None
        self._last = None

    # -- checkpoints ------------------------------------------------------------------------
    def checkpoint(self) -> CacheCheckpoint:
        rec = tuple((c.conv, c.state) if isinstance(c, RecurrentCache) else None for c in self.layers)
        return CacheCheckpoint(tuple(self.offsets), rec)

    def restore(self, ckpt: CacheCheckpoint) -> None:
        if len(ckpt.offsets) != self.batch_size or len(ckpt.recurrent) != len(self.layers):
            raise ValueError("checkpoint belongs to a cache of another shape")
        for layer, pair in zip(self.layers, ckpt.recurrent, strict=True):
            if isinstance(layer, RecurrentCache):
                layer.conv, layer.state = pair
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
        keep = _round_up(max(out.offsets, default=0))
        for src, dst in zip(self.layers, out.layers, strict=True):
            if isinstance(src, KVCache) and src.keys is not None:
                dst.keys, dst.values = src.keys[idx, :, :keep], src.values[idx, :, :keep]
            elif isinstance(src, RecurrentCache):
                dst.conv = None if src.conv is None else src.conv[idx]
                dst.state = None if src.state is None else src.state[idx]
        return out

    def filter(self, rows: Sequence[int]) -> None:
        """Keep only the given rows (sequences leaving the batch), in place."""
        kept = self.select(rows)
        self.layers, self.offsets, self._last = kept.layers, kept.offsets, None

    def extend(self, other: HybridCache) -> None:
        """Append other's sequences to this batch, in place."""
        merged = HybridCache.merge([self, other])
        self.layers, self.offsets, self._last = merged.layers, merged.offsets, None

    @staticmethod
    def merge(caches: Sequence[HybridCache]) -> HybridCache:
        """One batch made of all rows of `caches`, in order (same model required)."""
        if not caches or len({len(c.layers) for c in caches}) != 1:
            raise ValueError("merge needs caches of the same model")
        out = HybridCache([_clone_empty(c) for c in caches[0].layers], sum(c.batch_size for c in caches))
        out.offsets = [o for c in caches for o in c.offsets]
        for i, dst in enumerate(out.layers):
            parts = [c.layers[i] for c in caches]
            if isinstance(dst, KVCache):
                _merge_kv(dst, parts, [c.batch_size for c in caches], _round_up(max(out.offsets, default=0)))
            elif isinstance(dst, RecurrentCache):
                _merge_recurrent(dst, parts, [c.batch_size for c in caches])
        return out

    # -- memory -----------------------------------------------------------------------------
    def _recurrent(self) -> list[RecurrentCache]:
        return [c for c in self.layers if isinstance(c, RecurrentCache)]

    @property
    def kv_nbytes(self) -> int:
        return sum(c.nbytes for c in self.layers if isinstance(c, KVCache))

    @property
    def recurrent_nbytes(self) -> int:
        return sum(c.nbytes for c in self._recurrent())

    @property
    def nbytes(self) -> int:
        return self.kv_nbytes + self.recurrent_nbytes

    def state_arrays(self) -> list[mx.array]:
        """Every array the cache holds (for `mx.eval`)."""
        out: list[mx.array] = []
        for c in self.layers:
            if isinstance(c, KVCache) and c.keys is not None:
                out += [c.keys, c.values]
            elif isinstance(c, RecurrentCache):
                out += [a for a in (c.conv, c.state) if a is not None]
        return out


def _round_up(n: int) -> int:
    return max(-(-n // KV_STEP) * KV_STEP, 0)


def _clone_empty(c: LayerCache) -> LayerCache:
    if isinstance(c, KVCache):
        return KVCache(c.n_kv_heads, c.head_dim)
    if isinstance(c, RecurrentCache):
        return RecurrentCache(c.conv_shape, c.state_shape)
    return None


def _merge_kv(dst: KVCache, parts: list[KVCache], sizes: list[int], capacity: int) -> None:
    dtype = next((p.keys.dtype for p in parts if p.keys is not None), None)
    if dtype is None or capacity == 0:
        return
    keys, values = [], []
    for p, b in zip(parts, sizes, strict=True):
        shape = (b, dst.n_kv_heads, capacity, dst.head_dim)
        if p.keys is None:
            keys.append(mx.zeros(shape, dtype))
            values.append(mx.zeros(shape, dtype))
            continue
        have = min(p.keys.shape[2], capacity)
        pad = [(0, 0), (0, 0), (0, capacity - have), (0, 0)]
        keys.append(mx.pad(p.keys[:, :, :have], pad))
        values.append(mx.pad(p.values[:, :, :have], pad))
    dst.keys, dst.values = mx.concatenate(keys), mx.concatenate(values)


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
