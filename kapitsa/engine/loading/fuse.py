"""Projection fusion for inference: linears that read the same input become one matmul.

A decode step on MLX's GPU backends costs per launched op, and the mat-vecs of a layer are most
of its launches: Qwen3.5's Gated DeltaNet reads its input with four projections (qkv, z, b, a),
attention with three (q, k, v), a SwiGLU MLP with two (gate, up). Stacking their weights along
the output axis gives one mat-vec that reads the same bytes; the outputs are then split (views).

Rows of a weight matrix are independent in every format we load (float, MLX affine with per-row
groups, mxfp4/nvfp4 with per-row scales), so concatenating `weight`, `scales` and `biases` along
axis 0 is exact. Linears that differ in format (bits, group size, mode, bias) are left alone.

Only the engine fuses (`ModelRunner`): parameter names change, so anything that saves or compares
weights by name works on an unfused model.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn

from kapitsa.engine.ops.linear import normed_linear
from kapitsa.engine.traces import drop_traces

_QUANT_FIELDS = ("group_size", "bits", "mode")


def _signature(linear: nn.Module) -> tuple | None:
    if isinstance(linear, nn.QuantizedLinear):
        return ("q", *(getattr(linear, f, None) for f in _QUANT_FIELDS), "bias" in linear)
    if isinstance(linear, nn.Linear):
        return ("f", linear.weight.dtype, "bias" in linear)
    return None  # other layer types (LoRA wrappers, custom) keep their own forward


def fuse_linears(linears: Sequence[nn.Module]) -> nn.Module | None:
    """One linear computing `concat([l(x) for l in linears], -1)`, or None when they can't fuse."""
    signatures = {_signature(lin) for lin in linears}
    if len(signatures) != 1 or None in signatures:
        return None
    first = linears[0]
    fused = nn.Module.__new__(type(first))
    nn.Module.__init__(fused)
    for key in first:
        if isinstance(first[key], mx.array):
            fused[key] = mx.concatenate([lin[key] for lin in linears], axis=0)
    for f in _QUANT_FIELDS:
        if hasattr(first, f):
            setattr(fused, f, getattr(first, f))
    if isinstance(first, nn.QuantizedLinear):
        fused.freeze()
    return fused


def fuse_into(module: nn.Module, names: Sequence[str], fused_name: str) -> bool:
    """Replace `module.<names>` by one `module.<fused_name>` (and remember where its output
    splits); False, and nothing changed, when the linears can't fuse or are already fused."""
    if fused_name in module or not all(n in module for n in names):
        return False
    parts = [module[n] for n in names]
    fused = fuse_linears(parts)
    if fused is None:
        return False
    mx.eval(fused.parameters())
    for n in names:
        delattr(module, n)
    setattr(module, fused_name, fused)
    # a plain attribute, not a module entry: it must not show up among the parameters
    object.__setattr__(module, _splits_attr(fused_name), split_points([_out_features(p) for p in parts]))
    return True


def projections(module: nn.Module, x: mx.array, names: Sequence[str], fused_name: str) -> list[mx.array]:
    """`[module.<name>(x) for name in names]`, through the fused linear when `fuse_into` made one."""
    if fused_name in module:
        return mx.split(module[fused_name](x), getattr(module, _splits_attr(fused_name)), axis=-1)
    return [module[n](x) for n in names]


def normed_projections(
    module: nn.Module, norm: nn.Module, x: mx.array, names: Sequence[str], fused_name: str
) -> list[mx.array]:
    """`projections(module, norm(x), ...)`; with a fused linear, the norm can run inside its
    one-row mat-vec at decode (qlinear.normed_linear)."""
    if fused_name in module:
        out = normed_linear(norm, module[fused_name], x)
        return mx.split(out, getattr(module, _splits_attr(fused_name)), axis=-1)
    return projections(module, norm(x), names, fused_name)


def _splits_attr(fused_name: str) -> str:
    return f"_{fused_name}_splits"


def split_points(sizes: Sequence[int]) -> list[int]:
    """Cumulative boundaries for `mx.split` (all but the last)."""
    points, total = [], 0
    for s in sizes[:-1]:
        total += s
        points.append(total)
    return points


def _out_features(linear: nn.Module) -> int:
    return int(linear.weight.shape[0])


def fuse_model(model: nn.Module) -> int:
    """Call `fuse()` on every submodule that has one; returns how many fused. Idempotent."""
    count = 0
    for _, sub in model.named_modules():
        fuse = getattr(sub, "fuse", None)
        if callable(fuse) and fuse():
            count += 1
    if count:  # compiled decode steps traced before captured the unfused weights: drop them
        drop_traces(model)
    return count
