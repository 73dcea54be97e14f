"""The Gated DeltaNet step in MLX ops (`gdn_step_reference`, what the fused kernel of gdn.py is
tested against), the views its per-head inputs may be (`HeadView`, read in place from the fused
in-projection) and the shape checks both paths share."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from kapitsa.engine.ops.conv import causal_conv
from kapitsa.engine.ops.gated_delta import gated_delta, gdn_decay, l2norm_qk
from kapitsa.engine.ops.norm import _times_silu_f32
from kapitsa.errors import KapitsaError


class GdnShapeError(KapitsaError, ValueError):
    """Inputs of `gdn_step` whose shapes disagree with each other or with the head layout."""


@dataclass(frozen=True, eq=False)
class HeadView:
    """A per-head input (z: Dv values per head; a, b: one) read in place from a wider `[B, T, N]`
    array such as the fused in-projection.

    Within each (b, t) row, head h's values start at column
    `offset + (h // group) * group_stride + (h % group) * width`. Qwen3.5's fused projection:
    `HeadView(proj, offset_of_the_slice, group=Hv)`. Qwen3-Next packs per key head:
    `group = Hv // Hk`, `group_stride` = the packed width of one key head.
    """

    array: mx.array
    offset: int
    group: int
    group_stride: int = 0

    def columns(self, heads: int, width: int) -> mx.array:
        h, i = mx.arange(heads)[:, None], mx.arange(width)[None, :]
        return (self.offset + (h // self.group) * self.group_stride + (h % self.group) * width + i).reshape(
            -1
        )

    def materialize(self, heads: int, width: int) -> mx.array:
        """The `[B, T, heads * width]` array this view stands for (what the model's split gives)."""
        if self.group >= heads:  # one contiguous run of columns: a slice, no gather
            return self.array[..., self.offset : self.offset + heads * width]
        return mx.take(self.array, self.columns(heads, width), axis=-1)


Input = mx.array | HeadView


def projection_views(
    proj: mx.array, *, packed: bool, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int
) -> tuple[HeadView, HeadView, HeadView]:
    """(z, b, a) as views of GatedDeltaNet's fused in-projection output `[B, T, N]`, in the
    column order its `fuse()` builds: Qwen3.5 `[qkv | z | b | a]`; Qwen3-Next (`packed`)
    `[q k v z per key head | b a per key head]`."""
    hk, hv, dk, dv = num_k_heads, num_v_heads, head_k_dim, head_v_dim
    if not packed:
        zo = 2 * hk * dk + hv * dv
        return HeadView(proj, zo, hv), HeadView(proj, zo + hv * dv, hv), HeadView(proj, zo + hv * dv + hv, hv)
    per = hv // hk
    head_width = 2 * dk + 2 * per * dv  # one key head's q, k, v, z
    ba = hk * head_width
    return (
        HeadView(proj, 2 * dk + per * dv, per, head_width),
        HeadView(proj, ba, per, 2 * per),
        HeadView(proj, ba + per, per, 2 * per),
    )


def _plain(x: Input, heads: int, width: int) -> mx.array:
    return x.materialize(heads, width) if isinstance(x, HeadView) else x


def promote(a: mx.Dtype, b: mx.Dtype) -> mx.Dtype:
    """MLX's result type of a binary op on two floating dtypes."""
    if a == b:
        return a
    return mx.float32  # float32 wins; bfloat16 with float16 also promotes to float32


def gdn_step_reference(
    conv_in: mx.array,
    conv_weight: mx.array,
    a: Input,
    b: Input,
    A_log: mx.array,
    dt_bias: mx.array,
    z: Input,
    norm_weight: mx.array,
    state: mx.array | None,
    *,
    num_k_heads: int,
    num_v_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    norm_eps: float,
    mask: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """The model's op-by-op path (same functions GatedDeltaNet calls today).

    conv_in `[B, K-1+T, C]`, conv_weight `[C, K, 1]`, a/b `[B, T, Hv]`, A_log/dt_bias `[Hv]`,
    z `[B, T, Hv, Dv]` (or `[B, T, Hv*Dv]`), norm_weight `[Dv]`, state `[B, Hv, Dv, Dk]` float32
    or None (zeros), mask `[B, T]` bool or None. Returns (out `[B, T, Hv*Dv]`, new state).
    """
    hk, hv, dk, dv = num_k_heads, num_v_heads, head_k_dim, head_v_dim
    a, b, z = _plain(a, hv, 1), _plain(b, hv, 1), _plain(z, hv, dv)
    B, T = a.shape[:2]
    conv_out = causal_conv(conv_in, conv_weight)
    q, k, v = mx.split(nn.silu(conv_out), [hk * dk, 2 * hk * dk], axis=-1)
    q, k = l2norm_qk(q.reshape(B, T, hk, dk), k.reshape(B, T, hk, dk))
    v = v.reshape(B, T, hv, dv)
    g, beta = gdn_decay(A_log, a, dt_bias), mx.sigmoid(b)
    y, new_state = gated_delta(q, k, v, g, beta, state, mask)
    normed = mx.fast.rms_norm(y, norm_weight, norm_eps)  # GatedRMSNorm.__call__
    out = _times_silu_f32(normed, z.reshape(B, T, hv, dv))
    return out.reshape(B, T, hv * dv), new_state


ShapeKey = tuple | None  # an array's shape, or (array shape, offset, group, group stride) of a view


def shape_key(x: Input | None) -> ShapeKey:
    if x is None:
        return None
    if isinstance(x, HeadView):
        return (tuple(x.array.shape), x.offset, x.group, x.group_stride)
    return tuple(x.shape)


def check_shapes(
    conv_in: mx.array,
    conv_weight: mx.array,
    a: Input,
    b: Input,
    A_log: mx.array,
    dt_bias: mx.array,
    z: Input,
    norm_weight: mx.array,
    state: mx.array | None,
    mask: mx.array | None,
    *,
    num_k_heads: int,
    num_v_heads: int,
    head_k_dim: int,
    head_v_dim: int,
) -> None:
    """Raise GdnShapeError naming the first input whose shape disagrees with the head layout."""
    inputs = (conv_in, conv_weight, a, b, A_log, dt_bias, z, norm_weight, state, mask)
    validate_shape_keys(tuple(shape_key(x) for x in inputs), num_k_heads, num_v_heads, head_k_dim, head_v_dim)


@functools.lru_cache(maxsize=1024)  # a decode loop repeats the same shapes: validate them once
def validate_shape_keys(keys: tuple[ShapeKey, ...], hk: int, hv: int, dk: int, dv: int) -> None:
    conv_in, conv_weight, a, b, A_log, dt_bias, z, norm_weight, state, mask = keys
    if min(hk, hv, dk, dv) < 1 or hv % hk:
        raise GdnShapeError(f"bad head layout: {hk} k heads x {dk}, {hv} v heads x {dv}")
    a_shape = (*_view_shape(a)[:2], hv) if is_view_key(a) else a
    if len(a_shape) != 3 or a_shape[2] != hv:
        raise GdnShapeError(f"a must be [B, T, {hv}], got {list(a_shape)}")
    B, T = a_shape[:2]
    C = 2 * hk * dk + hv * dv
    if len(conv_weight) != 3 or conv_weight[0] != C or conv_weight[2] != 1:
        raise GdnShapeError(f"conv_weight must be [{C}, K, 1], got {list(conv_weight)}")
    K = conv_weight[1]
    expected = {"conv_in": (conv_in, (B, K - 1 + T, C)), "A_log": (A_log, (hv,)), "dt_bias": (dt_bias, (hv,))}
    expected["norm_weight"] = (norm_weight, (dv,))
    if not is_view_key(b):
        expected["b"] = (b, (B, T, hv))
    if state is not None:
        expected["state"] = (state, (B, hv, dv, dk))
    if mask is not None:
        expected["mask"] = (mask, (B, T))
    for name, (shape, want) in expected.items():
        if shape != want:
            raise GdnShapeError(f"{name} must be {list(want)}, got {list(shape)}")
    if not is_view_key(z) and z not in ((B, T, hv, dv), (B, T, hv * dv)):
        raise GdnShapeError(f"z must be [{B}, {T}, {hv}, {dv}], got {list(z)}")
    for name, key, width in (("a", a, 1), ("b", b, 1), ("z", z, dv)):
        if is_view_key(key):
            _check_view(name, key, B, T, hv, width)


def is_view_key(key: ShapeKey) -> bool:
    return key is not None and len(key) == 4 and isinstance(key[0], tuple)


def _view_shape(key: ShapeKey) -> tuple:
    return key[0]


def _check_view(name: str, key: ShapeKey, batch: int, tokens: int, heads: int, width: int) -> None:
    shape, offset, group, group_stride = key
    if len(shape) != 3 or shape[:2] != (batch, tokens):
        raise GdnShapeError(f"{name}.array must be [{batch}, {tokens}, N], got {list(shape)}")
    if min(offset, group_stride) < 0 or group < 1:
        raise GdnShapeError(f"{name} view {offset, group, group_stride} has a negative offset or empty group")
    last = offset + (heads - 1) // group * group_stride + ((heads - 1) % group + 1) * width
    if last > shape[2]:
        raise GdnShapeError(f"{name} view {offset, group, group_stride} runs past {shape[2]} columns")
