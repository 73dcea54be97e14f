"""Shared experts folded into the routed experts' stacks, for inference.

A shared expert is an MLP every token runs; a routed expert is the same MLP picked per token. When
the shared expert has the routed experts' format (same quantization, and an intermediate size that
is a whole number of theirs), its weights can be appended to the stacked expert tensors as one or
more extra experts, and every token routes to them with a fixed score (Qwen: sigmoid of its
shared-expert gate; Nemotron-H: 1). The expert kernels (kernels/moe.py) then read the shared
weights once per step with the routed ones, instead of three or four more kernels per MoE layer.

Exact: an MLP of intermediate size m*h equals the sum of m MLPs of size h over its row blocks
(the activation is elementwise), and rows of a quantized matrix (or groups of its columns) are
independent. Like projection fusion (fuse.py) only the engine folds: parameter names change.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn

from kapitsa.engine.ops.moe import QuantizedSwitchLinear

_PARTS = ("weight", "scales", "biases")


def _format(layer: nn.Module) -> tuple:
    return (layer.group_size, layer.bits, layer.mode, "biases" in layer)


def _compatible(stack: nn.Module, linears: Sequence[nn.Module]) -> bool:
    if type(stack) is not QuantizedSwitchLinear or "bias" in stack:
        return False
    for linear in linears:
        if (
            not isinstance(linear, nn.QuantizedLinear)
            or "bias" in linear
            or _format(linear) != _format(stack)
        ):
            return False
        if any(linear[p].shape != stack[p].shape[1:] for p in _PARTS if p in stack):
            return False
    return True


def split_rows(linear: nn.QuantizedLinear, pieces: int) -> list[nn.QuantizedLinear] | None:
    """`linear` as `pieces` linears over equal blocks of its output rows (None if they don't divide)."""
    rows = linear["weight"].shape[0]
    if rows % pieces:
        return None
    size = rows // pieces
    return [_sliced(linear, dict.fromkeys(_PARTS, _rows(i, size))) for i in range(pieces)]


def split_columns(linear: nn.QuantizedLinear, pieces: int) -> list[nn.QuantizedLinear] | None:
    """`linear` as `pieces` linears over equal blocks of its input columns, whose outputs sum to
    its output (None unless each block is whole quantization groups)."""
    groups, packed = linear["scales"].shape[-1], linear["weight"].shape[-1]
    if groups % pieces or packed % pieces:
        return None
    g, w = groups // pieces, packed // pieces
    if w * 32 // linear.bits != g * linear.group_size:
        return None  # a block would cut a group (packed words and groups don't line up)
    return [
        _sliced(linear, {"weight": _columns(i, w), "scales": _columns(i, g), "biases": _columns(i, g)})
        for i in range(pieces)
    ]


def _rows(i: int, size: int) -> tuple:
    return (slice(i * size, (i + 1) * size),)


def _columns(i: int, size: int) -> tuple:
    return (slice(None), slice(i * size, (i + 1) * size))


def _sliced(linear: nn.QuantizedLinear, index: dict[str, tuple]) -> nn.QuantizedLinear:
    part = nn.Module.__new__(nn.QuantizedLinear)
    nn.Module.__init__(part)
    for key in _PARTS:
        if key in linear:
            part[key] = linear[key][index[key]]
    part.group_size, part.bits, part.mode = linear.group_size, linear.bits, linear.mode
    part.freeze()
    return part


def append_experts(switch_mlp: nn.Module, experts: dict[str, Sequence[nn.Module]]) -> int | None:
    """Append experts to `switch_mlp`'s stacks: `experts` maps each of its projections ("gate_proj",
    "up_proj", "down_proj" or "fc1", "fc2") to one quantized linear per new expert. Returns the
    first new expert's index, or None (nothing changed) when any format or shape differs."""
    names = list(experts)
    counts = {len(experts[n]) for n in names}
    if not names or len(counts) != 1 or not all(n in switch_mlp for n in names):
        return None
    if not all(_compatible(switch_mlp[n], experts[n]) for n in names):
        return None
    first = switch_mlp[names[0]]["weight"].shape[0]
    for name in names:
        stack = switch_mlp[name]
        for key in _PARTS:
            if key in stack:
                stack[key] = mx.concatenate([stack[key], *(lin[key][None] for lin in experts[name])], axis=0)
        mx.eval(stack.parameters())
    return first


def shared_slots(indices: mx.array, scores: mx.array, first: int, count: int, score: mx.array | float):
    """`indices`/`scores` [..., k] with the folded shared experts `first..first+count-1` appended to
    every row at `score` ([..., 1] or a constant)."""
    lead = (*indices.shape[:-1], count)
    extra = mx.broadcast_to(mx.arange(first, first + count, dtype=indices.dtype), lead)
    weight = mx.full(lead, score, scores.dtype) if isinstance(score, float) else mx.broadcast_to(score, lead)
    return mx.concatenate([indices, extra], axis=-1), mx.concatenate(
        [scores, weight.astype(scores.dtype)], axis=-1
    )


def fold_shared_mlp(
    switch_mlp: nn.Module, rows: dict[str, nn.Module], columns: dict[str, nn.Module]
) -> tuple[int, int] | None:
    """Append a shared MLP to `switch_mlp` as experts; `rows` maps the stack names whose output is
    the MLP's intermediate (gate/up, fc1) to its linears, `columns` the stack names whose input it
    is (down, fc2). An intermediate of m times the experts' becomes m experts. Returns (first
    index, count), or None when it can't fold (nothing changed)."""
    if not rows or not columns:
        return None
    if not all(n in switch_mlp for n in [*rows, *columns]):
        return None
    hidden = switch_mlp[next(iter(rows))]["weight"].shape[1]
    linears = [*rows.values(), *columns.values()]
    if not all(isinstance(lin, nn.QuantizedLinear) for lin in linears):
        return None
    size = rows[next(iter(rows))]["weight"].shape[0]
    if size % hidden:
        return None
    pieces = size // hidden
    parts = {n: split_rows(lin, pieces) for n, lin in rows.items()}
    parts |= {n: split_columns(lin, pieces) for n, lin in columns.items()}
    if any(p is None for p in parts.values()):
        return None
    first = append_experts(switch_mlp, parts)
    return None if first is None else (first, pieces)
