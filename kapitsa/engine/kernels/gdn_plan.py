"""Launch planning of the fused Gated DeltaNet step (gdn.py): which calls the kernel takes
(`supports`), its template arguments and grid (`launch_config`), and the cached per-shape `Plan`
a decode loop reuses."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import mlx.core as mx

from kapitsa.engine.kernels import backend, float_bits
from kapitsa.engine.kernels.gdn_reference import (
    HeadView,
    ShapeKey,
    is_view_key,
    promote,
    shape_key,
    validate_shape_keys,
)

MAX_T = 16  # token counts compiled exactly: decode and verification chains (models/base.py CHAIN_MAX_T);
# gdn_prefill pads longer calls to a power of two, so prompts of any length share a few compiles
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
    validate_shape_keys(keys, hk, hv, dk, dv)
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
    if is_view_key(key):
        shape, offset, group, group_stride = key
        return (shape[2], offset, group, group_stride)
    return (heads * width, 0, heads, 0)
