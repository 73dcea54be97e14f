"""Mamba-2 selective state space scan (Nemotron-H).

Per head h (group g = h // (H/G)), state S `[P, N]` float32, per step t:

    dt = clip(softplus(dt_raw + dt_bias), lo, hi);  S = exp(dt * A) S + dt x_t B_t^T;  y_t = S C_t + D x_t

with A = -exp(A_log). Padding (`mask[b, t] == False`) is expressed as dt = 0, which makes the step
the identity on S; that is how ragged right-padded batches keep every sequence's own state.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from kapitsa.engine.options import DEFAULT_SSD_CHUNK


def ssm_dt(
    dt: mx.array, dt_bias: mx.array, limit: tuple[float, float], mask: mx.array | None = None
) -> mx.array:
    """Discretisation step `[B, T, H]` in float32; zero on masked (padding) steps."""
    dt = nn.softplus(dt.astype(mx.float32) + dt_bias.astype(mx.float32))
    lo, hi = limit
    if lo > 0.0 or math.isfinite(hi):
        dt = mx.clip(dt, lo, hi)
    if mask is not None:
        dt = mx.where(mask[..., None], dt, 0.0)
    return dt


def _heads(m: mx.array, heads: int) -> mx.array:
    """`[..., G, N]` -> `[..., H, N]` (each group serves H/G consecutive heads)."""
    groups = m.shape[-2]
    return mx.repeat(m, heads // groups, axis=-2) if groups != heads else m


def ssm_scan_reference(
    x: mx.array,
    dt: mx.array,
    A_log: mx.array,
    B: mx.array,
    C: mx.array,
    D: mx.array,
    state: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """Step-by-step scan. x `[B,T,H,P]`, dt `[B,T,H]` from `ssm_dt`, B,C `[B,T,G,N]`,
    state `[B,H,P,N]`. Returns (y `[B,T,H,P]` in x's dtype, final state float32)."""
    b, T, H, P = x.shape
    N = B.shape[-1]
    if state is None:
        state = mx.zeros((b, H, P, N), dtype=mx.float32)
    A = -mx.exp(A_log.astype(mx.float32))
    Bh, Ch = _heads(B, H).astype(mx.float32), _heads(C, H).astype(mx.float32)
    xf = x.astype(mx.float32)
    ys = []
    for t in range(T):
        decay = mx.exp(dt[:, t] * A)[..., None, None]
        inject = (dt[:, t, :, None] * xf[:, t])[..., None] * Bh[:, t, :, None, :]
        state = state * decay + inject
        ys.append((state @ Ch[:, t, :, :, None])[..., 0])
    y = mx.stack(ys, axis=1) + xf * D.astype(mx.float32)[:, None]
    return y.astype(x.dtype), state


def ssm_scan(
    x: mx.array,
    dt: mx.array,
    A_log: mx.array,
    B: mx.array,
    C: mx.array,
    D: mx.array,
    state: mx.array | None = None,
    chunk: int = DEFAULT_SSD_CHUNK,
) -> tuple[mx.array, mx.array]:
    """Same contract as `ssm_scan_reference`: one step for T == 1, else the chunked SSD form
    (quadratic within a chunk, recurrent across chunks), all in float32. `chunk`: tokens per
    chunk (KernelOptions.ssd_chunk)."""
    if x.shape[1] == 1:
        if state is None:
            state = mx.zeros((x.shape[0], x.shape[2], x.shape[3], B.shape[-1]), dtype=mx.float32)
        return _decode_step(x, dt, A_log, B, C, D, state)
    b, T, H, P = x.shape
    N = B.shape[-1]
    if state is None:
        state = mx.zeros((b, H, P, N), dtype=mx.float32)
    A = -mx.exp(A_log.astype(mx.float32))
    xf = x.astype(mx.float32)
    Bf, Cf = B.astype(mx.float32), C.astype(mx.float32)  # per group: never copied out to heads
    ys = []
    for start in range(0, T, chunk):
        end = min(start + chunk, T)
        y, state = _ssd_chunk(
            xf[:, start:end], dt[:, start:end], A, Bf[:, start:end], Cf[:, start:end], state
        )
        ys.append(y)
    y = mx.concatenate(ys, axis=1) + xf * D.astype(mx.float32)[:, None]
    return y.astype(x.dtype), state


@mx.compile  # a decode step is a dozen small ops; fused they cost one launch or a few
def _decode_step(x, dt, A_log, B, C, D, state):
    return ssm_scan_reference(x, dt, A_log, B, C, D, state)


def _ssd_chunk(x, dt, A, B, C, state):
    """One chunk. x `[b,L,H,P]`, dt `[b,L,H]`, B/C `[b,L,G,N]` (group g serves heads g*R to
    g*R + R - 1, R = H/G), state `[b,H,P,N]`. The C.B products are made once per group, not per
    head, and B and C are never copied out to heads: heads enter as an R axis beside G."""
    b, L, H, P = x.shape
    G, N = B.shape[-2:]
    R = H // G
    log_decay = mx.cumsum(dt * A, axis=1).transpose(0, 2, 1)  # [b,H,L]: sum of dt*A up to t
    diff = log_decay[..., :, None] - log_decay[..., None, :]  # [b,H,t,s]
    causal = mx.tril(mx.ones((L, L), dtype=mx.bool_))
    weights = mx.exp(mx.where(causal, diff, -mx.inf))  # decay from s to t, 0 above the diagonal
    cg, bg = C.transpose(0, 2, 1, 3), B.transpose(0, 2, 1, 3)  # [b,G,L,N]
    scores = (cg @ bg.swapaxes(-1, -2))[:, :, None] * weights.reshape(b, G, R, L, L)  # [b,G,R,t,s]
    dtx = (dt[..., None] * x).transpose(0, 2, 1, 3).reshape(b, G, R, L, P)
    y = scores @ dtx  # intra-chunk, [b,G,R,L,P]
    grouped = state.reshape(b, G, R, P, N)
    carried = cg[:, :, None] @ grouped.swapaxes(-1, -2)  # [b,G,R,L,P]
    y = y + mx.exp(log_decay).reshape(b, G, R, L)[..., None] * carried
    to_end = mx.exp(log_decay[..., -1:] - log_decay).reshape(b, G, R, L)
    new_state = mx.exp(log_decay[..., -1]).reshape(b, G, R)[..., None, None] * grouped
    new_state = new_state + (dtx * to_end[..., None]).swapaxes(-1, -2) @ bg[:, :, None]
    return y.reshape(b, H, L, P).transpose(0, 2, 1, 3), new_state.reshape(b, H, P, N)
