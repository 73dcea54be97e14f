"""Draft-tree verification helpers (hybrid-engine.md §5.5).

A tree of T nodes is given per batch row as `parents[t]` in DFS preorder (`parents[0] == -1`: the
root attaches to the committed prefix; `0 <= parents[t] < t` otherwise). Node t sits at position
`offset + depth(t)`, attends to the committed prefix and to its ancestors-or-self, and its
recurrent state comes from its parent's state. The reference recurrence here walks the nodes in
order with one step kernel call per node, which is fine for the 8-16 node trees worth verifying.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx
import numpy as np


def validate_parents(parents: Sequence[Sequence[int]], batch: int, T: int) -> list[list[int]]:
    rows = [list(p) for p in parents]
    if len(rows) != batch or any(len(p) != T for p in rows):
        raise ValueError(f"parents must give {T} nodes for each of {batch} rows")
    for p in rows:
        if p[0] != -1 or any(not 0 <= p[t] < t for t in range(1, T)):
            raise ValueError("tree nodes must be in preorder: parents[0] == -1, 0 <= parents[t] < t")
    return rows


def depths(parents: Sequence[int]) -> list[int]:
    out = [0] * len(parents)
    for t in range(1, len(parents)):
        out[t] = out[parents[t]] + 1
    return out


def ancestors_or_self(parents: Sequence[int]) -> np.ndarray:
    T = len(parents)
    anc = np.eye(T, dtype=bool)
    for t in range(1, T):
        anc[t] |= anc[parents[t]]
    return anc


def tree_attention_mask(parents: list[list[int]], offsets: list[int], kv_len: int) -> mx.array:
    """`[B, 1, T, kv_len]`: the committed prefix plus each node's ancestors-or-self."""
    T = len(parents[0])
    mask = np.zeros((len(parents), 1, T, kv_len), dtype=bool)
    for b, (p, off) in enumerate(zip(parents, offsets, strict=True)):
        mask[b, 0, :, :off] = True
        mask[b, 0, :, off : off + T] = ancestors_or_self(p)
    return mx.array(mask)


def tree_positions(parents: list[list[int]], offsets: list[int]) -> mx.array:
    """`[B, T]` int32 positions `offset + depth`."""
    return mx.array(
        [[o + d for d in depths(p)] for p, o in zip(parents, offsets, strict=True)], dtype=mx.int32
    )


def conv_windows(parents: list[list[int]], kernel: int) -> mx.array:
    """`[B, T, K]` rows of `conv_in = concat(conv_state [K-1], node rows [T])` forming each node's
    causal window: its K-1 nearest ancestors (continuing into the conv state) and itself."""
    out = np.zeros((len(parents), len(parents[0]), kernel), dtype=np.int32)
    for b, p in enumerate(parents):
        for t in range(len(p)):
            chain, node = [], t
            while node >= 0 and len(chain) < kernel:
                chain.append(kernel - 1 + node)
                node = p[node]
            state_row = kernel - 2
            while len(chain) < kernel:
                chain.append(state_row)
                state_row -= 1
            out[b, t] = chain[::-1]
    return mx.array(out)


def tree_conv(
    conv_in: mx.array, windows: mx.array, weight: mx.array, bias: mx.array | None = None
) -> mx.array:
    """Depthwise causal conv where each node reads its own window: `[B, T, C]`."""
    B, T, K = windows.shape
    rows = mx.take_along_axis(conv_in, windows.reshape(B, T * K, 1), axis=1).reshape(B, T, K, -1)
    out = (rows * weight[:, :, 0].T).sum(axis=2)
    return out if bias is None else out + bias


def tree_recurrence(
    step: Callable[[int, mx.array], tuple[mx.array, mx.array]], s0: mx.array, parents: list[list[int]]
) -> mx.array:
    """Run `step(t, parent_state) -> (y_t [B, 1, ...], state_t)` over the nodes; returns y `[B, T, ...]`."""
    T = len(parents[0])
    states: list[mx.array] = []
    ys = []
    for t in range(T):
        per_row = [p[t] for p in parents]
        if len(set(per_row)) == 1:
            start = s0 if per_row[0] < 0 else states[per_row[0]]
        else:
            start = mx.stack([(s0 if q < 0 else states[q])[b] for b, q in enumerate(per_row)])
        y, state = step(t, start)
        ys.append(y)
        states.append(state)
    return mx.concatenate(ys, axis=1)


def gather_time(x: mx.array, order: mx.array) -> mx.array:
    """`x[b, order[b, j], ...]` along axis 1."""
    B, P = order.shape
    return mx.take_along_axis(x, order.reshape(B, P, *([1] * (x.ndim - 2))), axis=1)
