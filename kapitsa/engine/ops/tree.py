"""Draft-tree verification helpers (hybrid-engine.md §5.5).

A tree of T nodes is given per batch row as `parents[t]` in DFS preorder (`parents[0] == -1`: the
root attaches to the committed prefix; `0 <= parents[t] < t` otherwise). Node t sits at position
`offset + depth(t)`, attends to the committed prefix and to its ancestors-or-self, and its
recurrent state comes from its parent's state.

The models run a tree's recurrence as its root-to-leaf paths (`tree_paths`): every path becomes a
chain of one `[B*P, D]` batch, so a layer makes one chain call, not one step call per node (a
node's graph is launch-bound on a GPU). Shared prefixes are recomputed per path; only the
recurrence runs again, not the projections. `tree_recurrence`, one step per node, is the reference.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

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


@dataclass(frozen=True)
class TreePaths:
    """A batch of trees as chains: path p of row b is chain `b * paths + p` of a `[B*P, D]` batch."""

    order: mx.array  # [B, P*D] int32: the node at each step of each path (padding repeats one)
    mask: mx.array | None  # [B*P, D] bool, True on real steps; None when no step is padding
    slots: mx.array  # [B, T] int32: the step of the first path through each node, in [0, P*D)
    paths: int  # P: the most leaves of any row
    depth: int  # D: the most nodes on any path


def leaf_paths(parents: Sequence[int], length: int) -> list[list[int]]:
    """Root-first node lists ending at each leaf among the first `length` nodes, in preorder;
    the nodes past `length` are the decoder's padding and belong to no path."""
    inner = {parents[t] for t in range(1, length)}
    out = []
    for leaf in (t for t in range(length) if t not in inner):
        path, node = [], leaf
        while node >= 0:
            path.append(node)
            node = parents[node]
        out.append(path[::-1])
    return out


def _row_steps(row: list[list[int]], P: int, D: int, T: int) -> tuple[np.ndarray, ...]:
    """One row's (order, mask) `[P, D]` and node slots `[T]`; padding nodes read step 0."""
    order, mask = np.zeros((P, D), np.int32), np.zeros((P, D), bool)
    slots = np.full(T, -1, np.int32)
    for p, path in enumerate(row):
        order[p, : len(path)], mask[p, : len(path)] = path, True
        order[p, len(path) :] = path[-1]
        for d, node in enumerate(path):
            if slots[node] < 0:
                slots[node] = p * D + d
    return order, mask, np.maximum(slots, 0)


def tree_paths(parents: list[list[int]], lengths: Sequence[int]) -> TreePaths:
    """The root-to-leaf paths of each row's first `lengths[b]` nodes, padded to P paths of D steps
    (a row with fewer leaves gets empty paths, a shorter path masked steps at its end)."""
    rows = [leaf_paths(p, n) for p, n in zip(parents, lengths, strict=True)]
    P = max(1, *map(len, rows))
    D = max([1] + [len(path) for row in rows for path in row])
    steps = [_row_steps(row, P, D, len(parents[0])) for row in rows]
    order, mask, slots = (np.stack(parts) for parts in zip(*steps, strict=True))
    return TreePaths(
        order=mx.array(order.reshape(len(rows), P * D)),
        mask=None if mask.all() else mx.array(mask.reshape(len(rows) * P, D)),
        slots=mx.array(slots),
        paths=P,
        depth=D,
    )


def gather_paths(x: mx.array, paths: TreePaths) -> mx.array:
    """Per-node inputs `[B, T, ...]` as the path chains `[B*P, D, ...]`."""
    return gather_time(x, paths.order).reshape(x.shape[0] * paths.paths, paths.depth, *x.shape[2:])


def node_outputs(y: mx.array, paths: TreePaths) -> mx.array:
    """Path outputs `[B*P, D, ...]` back at the nodes `[B, T, ...]`, each from the first path through it."""
    B = y.shape[0] // paths.paths
    return gather_time(y.reshape(B, paths.paths * paths.depth, *y.shape[2:]), paths.slots)


def repeat_rows(x: mx.array | None, paths: TreePaths) -> mx.array | None:
    """A per-row array (the state before the tree) once per path: `[B, ...]` -> `[B*P, ...]`."""
    return x if x is None or paths.paths == 1 else mx.repeat(x, paths.paths, axis=0)


def path_conv_in(conv_in: mx.array, kernel: int, paths: TreePaths) -> mx.array:
    """`conv_in` (conv state, then node rows) as each path's chain of conv rows `[B*P, K-1+D, C]`:
    a causal conv over a path gives each of its nodes the window `conv_windows` gives it."""
    state = repeat_rows(conv_in[:, : kernel - 1], paths)
    return mx.concatenate([state, gather_paths(conv_in[:, kernel - 1 :], paths)], axis=1)


def path_recurrence(
    chain: Callable[[tuple[mx.array, ...], mx.array | None, mx.array], mx.array],
    inputs: Sequence[mx.array],
    s0: mx.array,
    paths: TreePaths,
) -> mx.array:
    """`tree_recurrence` as one call of `chain(inputs [B*P, D, ...], mask [B*P, D] | None,
    s0 [B*P, ...]) -> y [B*P, D, ...]` over every path; returns y `[B, T, ...]`."""
    chains = tuple(gather_paths(x, paths) for x in inputs)
    return node_outputs(chain(chains, paths.mask, repeat_rows(s0, paths)), paths)
