"""Fused Gated DeltaNet step: conv + silu, q/k L2 norm, decay/beta, the gated delta rule over T
new tokens (decode T=1, speculative verification T<=MAX_T) and the gated RMS output norm, in one
kernel launch per layer.

`gdn_step` replaces, in `GatedDeltaNet.__call__` for chains (no draft tree), everything from
`causal_conv(conv_in, ...)` to `self.norm(y, z)`:

    out, state = gdn_step(conv_in, self.conv1d.weight, a, b, self.A_log, self.dt_bias, z,
                          self.norm.weight, s0, num_k_heads=self.nk, num_v_heads=self.nv,
                          head_k_dim=self.dk, head_v_dim=self.dv, norm_eps=self.norm.eps,
                          mask=info.recurrent_mask)
    return self.out_proj(out)   # out is [B, T, Hv*Dv], already gated and normed

The caller still takes the next conv state from `conv_in` (`conv_state_after`); the kernel does
not write it. z, a and b may be `HeadView`s of the fused in-projection (`projection_views`), read
in place, so no copies precede the launch. A rollback replay is `gdn_step(..., s0, mask=m)[1]`.
Dispatch: the kernel where `supports(...)` and the once-per-process `kernel_works` probe say so,
else the reference (`gdn_step_reference`, the ops the model runs today); it never fails.

Kernel layout (cuda_src/gdn_step.cu; metal/gdn_step.metal the same): one thread block per (batch
row, value head). The state `[Dv, Dk]` (float32) lives in registers for all T tokens: each warp
owns `Dv / NW` whole rows, its lanes split Dk in coalesced float4/float2 vectors, dot products
over Dk are warp shuffles. Per chunk of tokens the block computes the head's q/k/v conv outputs
into shared memory, normalises q and k (one warp per vector), runs the recurrence (y overwrites v
in place: the warp that reads v[r] writes y[r]), then applies the output norm (one warp per
token). Roundings to the activation dtype happen where the op-by-op path rounds, so bf16 results
track the model's current path closely.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from kapitsa.engine.kernels import backend, float_bits
from kapitsa.engine.kernels.cuda import CudaKernel, read_cuda_source
from kapitsa.engine.kernels.metal import MetalKernel
from kapitsa.engine.ops.conv import causal_conv
from kapitsa.engine.ops.gated_delta import gated_delta, gdn_decay, l2norm_qk
from kapitsa.engine.ops.norm import _times_silu_f32
from kapitsa.errors import KapitsaError

_log = logging.getLogger(__name__)
MAX_T = 64  # token counts compiled exactly (decode, verification); gdn_prefill pads longer calls
MAX_KERNEL_T = 8192  # one block per (row, head) walks the tokens: longer calls take the op path
MAX_HEAD_DIM = 256
MAX_CONV_KERNEL = 8
# State floats per thread (Dv/NW rows x Dk/32 columns). MLX writes the kernel signature, so there
# is no __launch_bounds__: registers x threads must fit the SM's 64K by construction. ptxas gives
# 56-72 registers at 32 floats (x 512 threads: half the SM) but 128 at 64 floats with 16 rows, so
# heads beyond Dk*Dv = 16384 (e.g. 256x128) take the reference. The compile test checks this.
MAX_STATE_FLOATS = 32
SHARED_BUDGET = {"cuda": 40 * 1024, "metal": 28 * 1024}  # under 48 KiB (CUDA) / 32 KiB (Metal)
MAX_WARPS = {"cuda": 16, "metal": 16}
_FLOATS = (mx.float32, mx.float16, mx.bfloat16)
INPUT_NAMES = ("conv_in", "conv_w", "a_in", "b_in", "a_log", "dt_bias", "z", "norm_w", "state_in", "mask")
OUTPUT_NAMES = ("out", "state_out")


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
    _validate(tuple(shape_key(x) for x in inputs), num_k_heads, num_v_heads, head_k_dim, head_v_dim)


@functools.lru_cache(maxsize=1024)  # a decode loop repeats the same shapes: validate them once
def _validate(keys: tuple[ShapeKey, ...], hk: int, hv: int, dk: int, dv: int) -> None:
    conv_in, conv_weight, a, b, A_log, dt_bias, z, norm_weight, state, mask = keys
    if min(hk, hv, dk, dv) < 1 or hv % hk:
        raise GdnShapeError(f"bad head layout: {hk} k heads x {dk}, {hv} v heads x {dv}")
    a_shape = (*_view_shape(a)[:2], hv) if _is_view(a) else a
    if len(a_shape) != 3 or a_shape[2] != hv:
        raise GdnShapeError(f"a must be [B, T, {hv}], got {list(a_shape)}")
    B, T = a_shape[:2]
    C = 2 * hk * dk + hv * dv
    if len(conv_weight) != 3 or conv_weight[0] != C or conv_weight[2] != 1:
        raise GdnShapeError(f"conv_weight must be [{C}, K, 1], got {list(conv_weight)}")
    K = conv_weight[1]
    expected = {"conv_in": (conv_in, (B, K - 1 + T, C)), "A_log": (A_log, (hv,)), "dt_bias": (dt_bias, (hv,))}
    expected["norm_weight"] = (norm_weight, (dv,))
    if not _is_view(b):
        expected["b"] = (b, (B, T, hv))
    if state is not None:
        expected["state"] = (state, (B, hv, dv, dk))
    if mask is not None:
        expected["mask"] = (mask, (B, T))
    for name, (shape, want) in expected.items():
        if shape != want:
            raise GdnShapeError(f"{name} must be {list(want)}, got {list(shape)}")
    if not _is_view(z) and z not in ((B, T, hv, dv), (B, T, hv * dv)):
        raise GdnShapeError(f"z must be [{B}, {T}, {hv}, {dv}], got {list(z)}")
    for name, key, width in (("a", a, 1), ("b", b, 1), ("z", z, dv)):
        if _is_view(key):
            _check_view(name, key, B, T, hv, width)


def _is_view(key: ShapeKey) -> bool:
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


def warps_for(dk: int, dv: int, max_warps: int) -> int:
    """Warps per block: a divisor of Dv (rows split evenly), the fewest that keep the state at
    MAX_STATE_FLOATS per thread (the most allowed when none does; `supports` then says no)."""
    divisors = [d for d in range(1, max_warps + 1) if dv % d == 0]
    fitting = [d for d in divisors if (dv // d) * (dk // 32) <= MAX_STATE_FLOATS]
    return min(fitting) if fitting else max(divisors)


def supports(
    conv_in: mx.array,
    conv_weight: mx.array,
    state: mx.array | None,
    *,
    num_k_heads: int,
    num_v_heads: int,
    head_k_dim: int,
    head_v_dim: int,
) -> bool:
    """Whether the fused kernel can run this call here (backend, dtypes, head dims, T)."""
    K = conv_weight.shape[1]
    return supported(
        backend(),
        conv_in.dtype,
        conv_weight.dtype,
        None if state is None else state.dtype,
        conv_in.shape[1] - (K - 1),
        K,
        num_k_heads,
        num_v_heads,
        head_k_dim,
        head_v_dim,
    )


def supported(
    kind, act, weight_dtype, state_dtype, T: int, K: int, hk: int, hv: int, dk: int, dv: int
) -> bool:
    if kind not in SHARED_BUDGET:
        return False
    if dk % 32 or dv % 32 or dk > MAX_HEAD_DIM or dv > MAX_HEAD_DIM or hv % hk:
        return False
    if act not in _FLOATS or weight_dtype not in _FLOATS:
        return False
    if state_dtype is not None and state_dtype != mx.float32:
        return False
    rows = dv // warps_for(dk, dv, MAX_WARPS[kind])
    return 1 <= T <= MAX_KERNEL_T and 1 <= K <= MAX_CONV_KERNEL and rows * dk // 32 <= MAX_STATE_FLOATS


def launch_config(
    kind: str,
    *,
    act: mx.Dtype,
    out_dtype: mx.Dtype,
    sum_dtype: mx.Dtype,
    beta_dtype: mx.Dtype,
    batch: int,
    T: int,
    K: int,
    num_k_heads: int,
    num_v_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    norm_eps: float,
    has_state: bool,
    has_mask: bool,
    layouts: dict[str, tuple[int, int, int, int]] | None = None,
) -> tuple[tuple, tuple[int, int, int], tuple[int, int, int]]:
    """(template arguments, grid in threads, threadgroup) for one launch on backend `kind`.

    `layouts` maps "Z", "A", "B" to (row length, offset, group, group stride) (see `_key_layout`);
    missing ones are contiguous."""
    hk, hv, dk, dv = num_k_heads, num_v_heads, head_k_dim, head_v_dim
    layouts = {"Z": (hv * dv, 0, hv, 0), "A": (hv, 0, hv, 0), "B": (hv, 0, hv, 0), **(layouts or {})}
    warps = warps_for(dk, dv, MAX_WARPS[kind])
    width = 2 * dk + dv
    chunk = min(T, SHARED_BUDGET[kind] // (4 * width + 12))  # q,k,v floats + g, beta, keep per token
    template = [
        ("T", act),
        ("OT", out_dtype),
        ("ST", sum_dtype),
        ("BT", beta_dtype),
        ("HK", hk),
        ("HV", hv),
        ("DK", dk),
        ("DV", dv),
        ("K", K),
        ("NT", T),
        ("TC", chunk),
        ("NW", warps),
        ("HAS_STATE", has_state),
        ("HAS_MASK", has_mask),
        ("EPS_BITS", float_bits(norm_eps)),
    ]
    for name in ("Z", "A", "B"):
        for field, value in zip(("ROW", "OFF", "GROUP", "GSTRIDE"), layouts[name], strict=True):
            template.append((f"{name}_{field}", value))
    threads = warps * 32
    return tuple(template), (batch * hv * threads, 1, 1), (threads, 1, 1)


# cuda_src/gdn_step.cu, with its helpers in gdn_step.cuh. Template arguments: T activation dtype
# (conv/silu/q/k/v/y roundings), OT output dtype, ST dtype of `a + dt_bias`, BT dtype of beta;
# HK, HV, DK, DV heads; K conv taps; NT tokens; TC tokens per shared-memory chunk; NW warps;
# HAS_STATE, HAS_MASK; EPS_BITS the norm eps as float bits; {Z,A,B}_{ROW,OFF,GROUP,GSTRIDE} where
# z, a and b sit in their arrays (HeadView).
# How the body reads row r of the conv window: from conv_in `[B, K-1+NT, C]` here; in the decode
# variant below from the conv state `[B, K-1, C]` then the new rows, the first C columns of x_new
# (rows of X_ROW values: the fused in-projection's output read in place).
_PLAIN_WINDOW = "#define GDN_WINDOW(r, c) ((float)conv_in[((size_t)bi * (K - 1 + NT) + (r)) * C + (c)])\n"
_SPLIT_WINDOW = (
    "#define GDN_WINDOW(r, c) ((r) < K - 1 ? (float)conv_state[((size_t)bi * (K - 1) + (r)) * C + (c)]"
    " : (float)x_new[((size_t)bi * NT + (r) - (K - 1)) * X_ROW + (c)])\n"
)
CUDA_KERNEL = CudaKernel(
    "kapitsa_gdn_step",
    INPUT_NAMES,
    OUTPUT_NAMES,
    _PLAIN_WINDOW + read_cuda_source("gdn_step.cu"),
    read_cuda_source("gdn_step.cuh"),
)
# The decode variant (`gdn_decode`): no concatenated conv_in before the launch and no slice of it
# after; the kernel reads the state and the new rows where they are and writes the next state.
DECODE_INPUT_NAMES = ("conv_state", "x_new", *INPUT_NAMES[1:])
DECODE_OUTPUT_NAMES = (*OUTPUT_NAMES, "conv_out")
CUDA_DECODE_KERNEL = CudaKernel(
    "kapitsa_gdn_decode",
    DECODE_INPUT_NAMES,
    DECODE_OUTPUT_NAMES,
    _SPLIT_WINDOW + read_cuda_source("gdn_step.cu") + read_cuda_source("gdn_conv_out.cu"),
    read_cuda_source("gdn_step.cuh"),
)
METAL_KERNEL = MetalKernel("kapitsa_gdn_step", "gdn_step.metal", INPUT_NAMES, OUTPUT_NAMES)


@functools.cache
def _stand_in(dtype: mx.Dtype) -> mx.array:
    """One evaluated element, made once: a fresh `mx.zeros` per call would cost a launch."""
    x = mx.zeros((1,), dtype)
    mx.eval(x)
    return x


def gdn_step(
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
    """Same contract as `gdn_step_reference`, one kernel launch where the backend has one."""
    inputs = (conv_in, conv_weight, a, b, A_log, dt_bias, z, norm_weight, state, mask)
    heads = (num_k_heads, num_v_heads, head_k_dim, head_v_dim)
    kind = backend()
    plan = plan_for(kind, inputs, heads, norm_eps)  # raises GdnShapeError on inconsistent shapes
    if plan is None or not kernel_works(kind):
        return gdn_step_reference(
            *inputs[:9],
            num_k_heads=num_k_heads,
            num_v_heads=num_v_heads,
            head_k_dim=head_k_dim,
            head_v_dim=head_v_dim,
            norm_eps=norm_eps,
            mask=mask,
        )
    return run_kernel(kind, plan, inputs)


@dataclass(frozen=True)
class Plan:
    """What a launch needs beyond the arrays; depends only on shapes, dtypes and heads."""

    template: tuple
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    output_shapes: tuple[tuple[int, ...], tuple[int, ...]]
    output_dtypes: tuple[mx.Dtype, mx.Dtype]


def plan_for(
    kind: str | None, inputs: tuple, heads: tuple[int, int, int, int], norm_eps: float
) -> Plan | None:
    """Validate the inputs' shapes and plan the launch (None: no kernel for this call here).
    Cached on shapes and dtypes, so a decode loop pays the Python once."""
    keys = tuple(shape_key(x) for x in inputs)
    dtypes = tuple(None if x is None else (x.array if isinstance(x, HeadView) else x).dtype for x in inputs)
    limits = (SHARED_BUDGET.get(kind), MAX_WARPS.get(kind))  # in the key: tests change them
    return _plan(kind, keys, dtypes, heads, norm_eps, limits)


@functools.lru_cache(maxsize=1024)
def _plan(kind, keys, dtypes, heads, norm_eps, limits) -> Plan | None:
    hk, hv, dk, dv = heads
    _validate(keys, hk, hv, dk, dv)
    conv_in, conv_w, a, b, _, _, z, _, state, mask = keys
    act_in, w_dtype, a_dtype, b_dtype, _, dt_dtype, _, norm_dtype, state_dtype, _ = dtypes
    B, K = conv_in[0], conv_w[1]
    T = conv_in[1] - (K - 1)
    if not supported(kind, act_in, w_dtype, state_dtype, T, K, hk, hv, dk, dv):
        return None
    act = promote(act_in, w_dtype)
    out_dtype = promote(act, norm_dtype)
    template, grid, threadgroup = launch_config(
        kind,
        act=act,
        out_dtype=out_dtype,
        sum_dtype=promote(a_dtype, dt_dtype),
        beta_dtype=b_dtype,
        batch=B,
        T=T,
        K=K,
        num_k_heads=hk,
        num_v_heads=hv,
        head_k_dim=dk,
        head_v_dim=dv,
        norm_eps=norm_eps,
        has_state=state is not None,
        has_mask=mask is not None,
        layouts={"Z": _key_layout(z, hv, dv), "A": _key_layout(a, hv, 1), "B": _key_layout(b, hv, 1)},
    )
    return Plan(template, grid, threadgroup, ((B, T, hv * dv), (B, hv, dv, dk)), (out_dtype, mx.float32))


def _key_layout(key: ShapeKey, heads: int, width: int) -> tuple[int, int, int, int]:
    """(row length, offset, group, group stride) of a plain array or a view, from its shape key."""
    if _is_view(key):
        shape, offset, group, group_stride = key
        return (shape[2], offset, group, group_stride)
    return (heads * width, 0, heads, 0)


def _kernel_arrays(inputs: tuple) -> list[mx.array]:
    """`gdn_step`'s inputs as the kernel takes them: views as their arrays, and a one-element
    stand-in for an absent state or mask (one signature; HAS_* skip reading them)."""
    conv_in, conv_weight, a, b, A_log, dt_bias, z, norm_weight, state, mask = inputs
    if mask is not None and mask.dtype != mx.bool_:
        mask = mask.astype(mx.bool_)
    return [
        conv_in,
        conv_weight,
        _array(a),
        _array(b),
        A_log,
        dt_bias,
        _array(z),
        norm_weight,
        state if state is not None else _stand_in(mx.float32),
        mask if mask is not None else _stand_in(mx.bool_),
    ]


def run_kernel(kind: str, plan: Plan, inputs: tuple) -> tuple[mx.array, mx.array]:
    """Launch the backend's kernel on `gdn_step`'s inputs (a planned, supported call)."""
    kernel = CUDA_KERNEL if kind == "cuda" else METAL_KERNEL
    out, new_state = kernel(
        _kernel_arrays(inputs),
        template=plan.template,
        grid=plan.grid,
        threadgroup=plan.threadgroup,
        output_shapes=plan.output_shapes,
        output_dtypes=plan.output_dtypes,
    )
    return out, new_state


def _array(x: Input) -> mx.array:
    return x.array if isinstance(x, HeadView) else x


def _probe_inputs(T: int, seed: int) -> tuple:
    """`gdn_step`'s inputs (no mask) for the kernels' one-time checks: one key head, two value
    heads of 128, a conv of 4 taps; their own random keys, so the global seed stays untouched."""
    keys = mx.random.split(mx.random.key(seed), 5)
    hk, hv, d = 1, 2, 128
    C = 2 * hk * d + hv * d
    return (
        mx.random.normal((1, 3 + T, C), key=keys[0]),
        0.5 * mx.random.normal((C, 4, 1), key=keys[1]),
        mx.random.normal((1, T, hv), key=keys[2]),
        mx.random.normal((1, T, hv), key=keys[3]),
        mx.zeros((hv,)),
        mx.zeros((hv,)),
        mx.ones((1, T, hv, d)),
        mx.ones((d,)),
        0.1 * mx.random.normal((1, hv, d, d), key=keys[4]),
    )


_PROBE_HEADS = dict(num_k_heads=1, num_v_heads=2, head_k_dim=128, head_v_dim=128)


def _agrees(kind: str, what: str, compare) -> bool:
    """Run `compare()` -> (kernel outputs, reference outputs), or None when there is no kernel for
    the case; whether every output is within a loose 1e-2 of the reference (this catches a broken
    kernel, not rounding). Failures are logged and answer False."""
    try:
        pair = compare()
        if pair is None:
            return False
        errors = [float(mx.abs(g - r).max() / mx.abs(r).max()) for g, r in zip(*pair, strict=True)]
    except (RuntimeError, ValueError) as exc:
        _log.warning("%s unavailable on %s, using the op path: %s", what, kind, exc)
        return False
    if not max(errors) < 1e-2:
        _log.warning("%s disagrees with the op path on %s (%s); not using it", what, kind, errors)
        return False
    return True


@functools.cache
def kernel_works(kind: str) -> bool:
    """Whether this backend's kernel compiles, runs and roughly agrees with the reference on one
    small case, checked once per process: a kernel's errors surface only at evaluation, in the
    middle of a forward, and `gdn_step` must never fail. Otherwise it keeps to the reference."""
    inputs = (*_probe_inputs(2, seed=0), mx.array([[True, False]]))
    heads = tuple(_PROBE_HEADS.values())

    def compare():
        plan = plan_for(kind, inputs, heads, 1e-6)
        if plan is None:
            return None
        ref = gdn_step_reference(*inputs[:9], **_PROBE_HEADS, norm_eps=1e-6, mask=inputs[9])
        return run_kernel(kind, plan, inputs), ref

    return _agrees(kind, "fused GDN step kernel", compare)


@dataclass(frozen=True)
class _Window:
    """The shape and dtype of the conv window `[B, K-1+T, C]` that `gdn_decode` never builds, for
    the planner (which reads only `.shape` and `.dtype` of conv_in)."""

    shape: tuple[int, int, int]
    dtype: mx.Dtype


def gdn_decode(
    conv_state: mx.array,
    x_new: mx.array,
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
    fused: bool = True,
) -> tuple[mx.array, mx.array, mx.array]:
    """`gdn_step` on `concatenate([conv_state, x_new[..., :C]], axis=1)`, also returning the next
    conv state (the window's last K-1 rows): (out, conv state, state). x_new `[B, T, N]`, N >= C:
    its first C columns are the new conv rows (Qwen3.5's fused in-projection output as it is).

    On CUDA one launch reads the conv state and x_new in place and writes the next conv state,
    so the concatenation and the two slices around it are not primitives of the step. `fused`
    False: the op-by-op path (`gdn_step_reference`) on the concatenated window, no kernel."""
    C, K = conv_weight.shape[0], conv_weight.shape[1]
    B, T = x_new.shape[:2]
    heads = dict(
        num_k_heads=num_k_heads, num_v_heads=num_v_heads, head_k_dim=head_k_dim, head_v_dim=head_v_dim
    )
    kind = backend()
    if (
        fused
        and kind == "cuda"
        and x_new.ndim == 3
        and x_new.shape[-1] >= C
        and conv_state.shape == (B, K - 1, C)
        and conv_state.dtype == x_new.dtype
    ):
        window = _Window((B, K - 1 + T, C), x_new.dtype)
        inputs = (window, conv_weight, a, b, A_log, dt_bias, z, norm_weight, state, None)
        plan = plan_for(kind, inputs, tuple(heads.values()), norm_eps)
        if plan is not None and decode_kernel_works(kind):
            return _run_decode(plan, conv_state, x_new, inputs[1:])
    new_rows = x_new if x_new.shape[-1] == C else x_new[..., :C]
    conv_in = mx.concatenate([conv_state, new_rows], axis=1)
    step = gdn_step if fused else gdn_step_reference
    out, new_state = step(
        conv_in, conv_weight, a, b, A_log, dt_bias, z, norm_weight, state, **heads, norm_eps=norm_eps
    )
    return out, conv_in[:, T:], new_state


def _run_decode(plan: Plan, conv_state: mx.array, x_new: mx.array, rest: tuple) -> tuple[mx.array, ...]:
    """Launch the decode variant; `rest` is `gdn_step`'s inputs after conv_in."""
    B, K1, C = conv_state.shape
    out, new_state, conv_out = CUDA_DECODE_KERNEL(
        [conv_state, x_new, *_kernel_arrays((None, *rest))[1:]],
        template=(*plan.template, ("X_ROW", x_new.shape[-1]), ("CT", conv_state.dtype)),
        grid=plan.grid,
        threadgroup=plan.threadgroup,
        output_shapes=(*plan.output_shapes, (B, K1, C)),
        output_dtypes=(*plan.output_dtypes, conv_state.dtype),
    )
    return out, conv_out, new_state


def probe() -> None:
    """Run the kernels' one-time checks where they apply (CUDA). They evaluate, so a model calls
    this before tracing a decode step that may launch them."""
    if backend() == "cuda":
        decode_kernel_works("cuda")


@functools.cache
def decode_kernel_works(kind: str) -> bool:
    """Whether the decode variant compiles, runs and agrees with the concatenating path on one
    small case (x_new wider than the conv channels, as the fused projection is); once per process."""
    if not kernel_works(kind):
        return False
    conv_in, *rest = _probe_inputs(1, seed=1)
    conv_state, rows = conv_in[:, :3], conv_in[:, 3:]
    x_new = mx.concatenate([rows, mx.ones((1, 1, 40))], axis=-1)

    def compare():
        window = _Window(conv_in.shape, conv_in.dtype)
        plan = plan_for(kind, (window, *rest, None), tuple(_PROBE_HEADS.values()), 1e-6)
        if plan is None:
            return None
        out, state = gdn_step_reference(conv_in, *rest, **_PROBE_HEADS, norm_eps=1e-6)
        return _run_decode(plan, conv_state, x_new, (*rest, None)), (out, conv_in[:, 1:], state)

    return _agrees(kind, "GDN decode kernel", compare)
