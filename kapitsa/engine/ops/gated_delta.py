"""Gated delta rule (Qwen3.5 / Qwen3-Next linear attention).

Per value head, with state S `[Dv, Dk]` (float32), per step t:

    S = g_t * S;  delta = beta_t * (v_t - S k_t);  S = S + delta k_t^T;  y_t = S q_t

`mask[b, t] == False` leaves the state untouched and yields y = 0 (right padding, replay of an
accepted prefix). q/k arrive L2-normalised with the `Dk^-0.5` readout scale folded into q.
"""

from __future__ import annotations

from functools import cache, partial

import mlx.core as mx
import mlx.nn as nn

from kapitsa.engine.kernels import cpu_blas
from kapitsa.engine.kernels.cpu_gdn import gated_delta_chunked


@partial(mx.compile, shapeless=True)  # one fused kernel per decode step instead of six
def gdn_decay(A_log: mx.array, a: mx.array, dt_bias: mx.array) -> mx.array:
    """Linear-space decay `g = exp(-exp(A_log) * softplus(a + dt_bias))`, float32 `[B, T, Hv]`."""
    return mx.exp(-mx.exp(A_log.astype(mx.float32)) * nn.softplus((a + dt_bias).astype(mx.float32)))


@mx.compile
def l2norm_qk(q: mx.array, k: mx.array, eps: float = 1e-6) -> tuple[mx.array, mx.array]:
    """`x / sqrt(sum x^2 + eps)` for q and k, then q scaled by `Dk^-0.5` (the readout scale).

    Written with `mx.fast.rms_norm` (mean instead of sum, so eps is divided by Dk).
    """
    dk = q.shape[-1]
    inv = dk**-0.5
    q = (inv * inv) * mx.fast.rms_norm(q, None, eps / dk)
    k = inv * mx.fast.rms_norm(k, None, eps / dk)
    return q, k


def gated_delta_reference(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array | None = None,
    mask: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """Plain sequential loop. q,k `[B,T,Hk,Dk]`, v `[B,T,Hv,Dv]`, g,beta `[B,T,Hv]`,
    state `[B,Hv,Dv,Dk]` float32. Returns (y `[B,T,Hv,Dv]` in v's dtype, final state)."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    if Hv > Hk:  # grouped heads: each k head serves Hv // Hk value heads
        q, k = mx.repeat(q, Hv // Hk, axis=2), mx.repeat(k, Hv // Hk, axis=2)
    ys = []
    for t in range(T):
        qt, kt, vt = (x[:, t].astype(mx.float32) for x in (q, k, v))
        decayed = state * g[:, t, :, None, None]
        delta = beta[:, t, :, None] * (vt - (decayed @ kt[..., None])[..., 0])
        new = decayed + delta[..., None] * kt[:, :, None, :]
        if mask is not None:
            keep = mask[:, t, None, None, None]
            new = mx.where(keep, new, state)
        y = (new @ qt[..., None])[..., 0]
        if mask is not None:
            y = mx.where(mask[:, t, None, None], y, 0.0)
        ys.append(y.astype(v.dtype))
        state = new
    return mx.stack(ys, axis=1), state


def gated_delta(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array | None = None,
    mask: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """Same contract as `gated_delta_reference`, through `mx.fast.gated_delta_update` (a fused
    sequential kernel; the state stays float32). Falls back to the reference where the build
    lacks the kernel. Long chains on the CPU device take the chunked BLAS form (kernels/cpu_gdn.py)."""
    if state is None:
        B, _, _, Dk = q.shape
        Hv, Dv = v.shape[-2:]
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    if cpu_blas.takes_tokens(q.shape[1]):
        try:
            return gated_delta_chunked(q, k, v, g, beta, state, mask)
        except cpu_blas.Traced:
            pass
    if fast_kernel_works():
        y, new_state = mx.fast.gated_delta_update(q, k, v, g, beta, state, mask)
        return y, new_state
    return gated_delta_reference(q, k, v, g, beta, state, mask)


@cache
def fast_kernel_works() -> bool:
    """Whether this MLX build has `mx.fast.gated_delta_update` for the default device.

    Kernel errors surface only at evaluation, so probe once with a tiny input."""
    if not hasattr(mx.fast, "gated_delta_update"):
        return False
    try:
        z = mx.zeros((1, 1, 1, 32))
        mx.eval(
            mx.fast.gated_delta_update(
                z, z, z, mx.ones((1, 1, 1)), mx.ones((1, 1, 1)), mx.zeros((1, 1, 32, 32))
            )
        )
        return True
    except (RuntimeError, ValueError):
        return False
