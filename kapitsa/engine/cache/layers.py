"""The per-layer caches of one forward: what a step is (`StepInfo`), attention's `KVCache`, a recurrent
layer's `RecurrentCache` and the `ReplayRecord` a recorded forward keeps for rollback."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import mlx.core as mx

from kapitsa.engine.ops import tree

KV_STEP = 256  # KV buffers grow in multiples of this many positions


@dataclass
class StepInfo:
    """What the layers of one forward need to know about the batch (built by `HybridCache.begin`)."""

    T: int
    lengths: list[int]  # tokens consumed per row (<= T)
    offsets: list[int]  # tokens already held per row before this forward
    record: bool = False  # keep replay records for `rollback`
    parents: list[list[int]] | None = None  # draft tree per row (see ops/tree.py); None = chains
    # Rope position minus cache position per row (a Qwen3.5-VL image takes fewer positions than
    # tokens); None: every row's tokens sit at their cache positions.
    rope_deltas: list[int] | None = None
    # `[3, B, T]` multi-axis rope positions of a prefill chunk with image tokens; None: rope at
    # `rope_base[b] + t` on every axis.
    positions: mx.array | None = None
    _windows: dict[int, mx.array] = field(default_factory=dict, repr=False)
    memo: dict[object, object] = field(default_factory=dict, repr=False)  # per-forward masks of cache types

    @property
    def ragged(self) -> bool:
        return any(n != self.T for n in self.lengths)

    @cached_property  # asked by every layer of a forward
    def plain_decode(self) -> bool:
        """One token per row, no padding, no tree, no replay record: the steady decode step."""
        plain = self.T == 1 and not self.record and self.parents is None
        return plain and not self.ragged and self.positions is None

    @cached_property
    def rope_base(self) -> list[int]:
        """Each row's rope position of its first token in this forward."""
        if not self.rope_deltas:
            return self.offsets
        return [o + d for o, d in zip(self.offsets, self.rope_deltas, strict=True)]

    @cached_property
    def offsets_array(self) -> mx.array:
        """`[B]` int32 rope positions of each row's first token, one array per forward for every layer."""
        return mx.array(self.rope_base, dtype=mx.int32)

    @cached_property  # asked by every attention layer of a forward
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
        base = self.rope_base
        return base[0] if len(set(base)) <= 1 else self.offsets_array

    def conv_windows(self, kernel: int) -> mx.array:
        """`[B, T, K]` conv rows of each tree node (computed once per kernel size)."""
        if kernel not in self._windows:
            self._windows[kernel] = tree.conv_windows(self.parents, kernel)
        return self._windows[kernel]

    @cached_property
    def tree_paths(self) -> tree.TreePaths:
        """The tree's root-to-leaf paths as one batch of chains (every recurrent layer's)."""
        return tree.tree_paths(self.parents, self.lengths)

    @cached_property
    def tree_positions(self) -> mx.array:
        """`[B, T]` per-node positions of a tree forward (offset + depth)."""
        return tree.tree_positions(self.parents, self.rope_base)

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
    """K/V of one attention layer: `[B, Hkv, capacity, D]`, positions >= offsets[b] are scratch.

    A decode step through kapitsa's CUDA attention kernel writes its row into a tail instead
    (`append_row`): a buffer of KV_STEP rows that the kernel reads after the cache's own. Writing a
    row into an array costs a copy of the whole array wherever MLX cannot update it in place, and on
    CUDA it cannot while an earlier step that reads the array is still queued (the backend holds
    every input of queued work): a copy of the whole cache per layer and step, against a copy of
    the tail. The tail is folded into the cache when it is full, when another position comes, and
    before anything else reads `keys` or `values`, so every other reader sees one buffer."""

    has_tail = True  # `append_row` applies (a quantized cache has none)

    def __init__(self, n_kv_heads: int, head_dim: int):
        self.n_kv_heads, self.head_dim = n_kv_heads, head_dim
        self._keys: mx.array | None = None
        self._values: mx.array | None = None
        self._tail: _Tail | None = None

    @property
    def keys(self) -> mx.array | None:
        self._fold()
        return self._keys

    @keys.setter
    def keys(self, array: mx.array | None) -> None:
        self._fold()  # the tail's values still belong in `values`
        self._keys = array

    @property
    def values(self) -> mx.array | None:
        self._fold()
        return self._values

    @values.setter
    def values(self, array: mx.array | None) -> None:
        self._fold()
        self._values = array

    def update(self, k: mx.array, v: mx.array, info: StepInfo) -> tuple[mx.array, mx.array]:
        """Write `k, v [B, Hkv, T, D]` at each row's offset; return the keys/values to attend."""
        B, _, T, _ = k.shape
        self._fold()
        self._reserve(B, info.kv_len, k.dtype)
        if info.uniform_offsets:
            start = info.offsets[0]
            self._keys = mx.slice_update(self._keys, k, mx.array([start]), (2,))
            self._values = mx.slice_update(self._values, v, mx.array([start]), (2,))
        else:
            pos = (mx.array(info.offsets)[:, None] + mx.arange(T))[:, None, :, None]
            self._keys = mx.put_along_axis(self._keys, pos, k, axis=2)
            self._values = mx.put_along_axis(self._values, pos, v, axis=2)
        return self._keys[:, :, : info.kv_len], self._values[:, :, : info.kv_len]

    def append_row(self, k: mx.array, v: mx.array, info: StepInfo) -> tuple[mx.array, ...]:
        """A decode step's write (`k, v [B, Hkv, 1, D]`, one position for every row, each at its
        own offset) into the tail -> (keys, values, committed, tail keys, tail values): the cache's
        buffers, the rows of them before the tail (one count, or one per row where rows differ),
        and the tail's buffers, whose first rows follow: row b's up to its offset."""
        B = k.shape[0]
        positions = info.offsets
        tail = self._tail
        if tail is None or not tail.continued_by(positions):
            self._fold()
            self._reserve(B, max(*positions, 1), k.dtype)
            shape = (B, self.n_kv_heads, KV_STEP, self.head_dim)
            dtype = self._keys.dtype  # rows cast as `update` casts them
            tail = self._tail = _Tail(mx.zeros(shape, dtype), mx.zeros(shape, dtype), list(positions))
        at = mx.array([tail.count])
        tail.keys = mx.slice_update(tail.keys, k, at, (2,))
        tail.values = mx.slice_update(tail.values, v, at, (2,))
        tail.count += 1
        return self._keys, self._values, tail.committed, tail.keys, tail.values

    def buffers(self) -> tuple[mx.array | None, mx.array | None]:
        """The cache's own buffers as they are (without the tail's rows): their shape and dtype."""
        return self._keys, self._values

    def eval_arrays(self) -> tuple[mx.array, ...]:
        """Every array this layer holds, tail included, for `mx.eval` (nothing folded: a forward
        that evaluates its cache each step would otherwise copy the whole cache each step)."""
        own = () if self._keys is None or self._values is None else (self._keys, self._values)
        tail = self._tail
        return own if tail is None else (*own, tail.keys, tail.values)

    def _fold(self) -> None:
        """Write the tail's rows into the cache's buffers (one copy of each) and drop the tail."""
        tail, self._tail = self._tail, None
        if tail is None or tail.count == 0:
            return
        self._reserve(tail.keys.shape[0], max(tail.starts) + tail.count, tail.keys.dtype)
        rows_k, rows_v = tail.keys[:, :, : tail.count], tail.values[:, :, : tail.count]
        if isinstance(tail.committed, int):
            at = mx.array([tail.committed])
            self._keys = mx.slice_update(self._keys, rows_k, at, (2,))
            self._values = mx.slice_update(self._values, rows_v, at, (2,))
        else:
            pos = (mx.array(tail.starts)[:, None] + mx.arange(tail.count))[:, None, :, None]
            self._keys = mx.put_along_axis(self._keys, pos, rows_k, axis=2)
            self._values = mx.put_along_axis(self._values, pos, rows_v, axis=2)

    def _reserve(self, batch: int, needed: int, dtype: mx.Dtype) -> None:
        have = 0 if self._keys is None else self._keys.shape[2]
        if needed <= have:
            return
        grow = -(-(needed - have) // KV_STEP) * KV_STEP
        shape = (batch, self.n_kv_heads, grow, self.head_dim)
        pad_k, pad_v = mx.zeros(shape, dtype), mx.zeros(shape, dtype)
        if self._keys is None:
            self._keys, self._values = pad_k, pad_v
        else:
            self._keys = mx.concatenate([self._keys, pad_k], axis=2)
            self._values = mx.concatenate([self._values, pad_v], axis=2)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.eval_arrays())

    # The layer's arrays with the token axis at 2, for code that moves rows or positions without
    # knowing the storage (batching, tree commits, the prefix cache): (K, V) here; a quantized
    # cache has six (cache/quantized_kv.py).
    def slots(self) -> tuple[mx.array, ...]:
        keys, values = self.keys, self.values
        return () if keys is None or values is None else (keys, values)

    def set_slots(self, arrays: Sequence[mx.array]) -> None:
        self.keys, self.values = tuple(arrays) if arrays else (None, None)

    def empty_like(self) -> KVCache:
        return KVCache(self.n_kv_heads, self.head_dim)

    def bytes_per_token(self, dtype: mx.Dtype) -> int:
        return 2 * self.n_kv_heads * self.head_dim * dtype.size


@dataclass
class _Tail:
    """Row b's positions `starts[b] .. starts[b] + count - 1` of a KVCache, written since its
    buffers were last folded."""

    keys: mx.array  # [B, Hkv, KV_STEP, D]
    values: mx.array
    starts: list[int]
    count: int = 0
    committed: int | list[int] = field(init=False)  # starts, one count when every row has the same

    def __post_init__(self) -> None:
        self.committed = self.starts[0] if len(set(self.starts)) == 1 else self.starts

    def continued_by(self, positions: list[int]) -> bool:
        """Whether a step writing at `positions` appends to this tail (room left, no row moved)."""
        if self.count == KV_STEP:
            return False
        if isinstance(self.committed, int):  # every row at one position: the common step
            at = self.committed + self.count
            return len(positions) == len(self.starts) and all(p == at for p in positions)
        return positions == [s + self.count for s in self.starts]


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


def _round_up(n: int) -> int:
    return max(-(-n // KV_STEP) * KV_STEP, 0)
