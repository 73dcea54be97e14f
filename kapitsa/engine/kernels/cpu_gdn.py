"""The gated delta rule for long chains on MLX's CPU device: chunked, through NumPy's BLAS.

`mx.fast.gated_delta_update` on the CPU steps token by token (~110 us a token for a layer of
8 value heads of 32x32), which makes the recurrence most of a long prompt's prefill there. The
chunked form does the same recurrence as a few small mat-muls per 64 tokens: within a chunk the
deltas `u_t = beta_t (v_t - g_t S_{t-1} k_t)` solve one unit lower-triangular system, and the
outputs and the state after the chunk follow from them (the WY form of the delta rule, with the
decays as exact ratios of cumulative products). The reference is ops/gated_delta.py's
sequential loop (tests/kernels/test_cpu_gdn.py compares them).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from kapitsa.engine.kernels.cpu_blas import host_array

CHUNK = 64


def gated_delta_chunked(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    mask: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """Same contract as `ops.gated_delta.gated_delta_reference` (q,k `[B,T,Hk,Dk]`, v `[B,T,Hv,Dv]`,
    g, beta `[B,T,Hv]`, state `[B,Hv,Dv,Dk]` float32; a False mask position leaves the state and
    yields 0). Raises `cpu_blas.Traced` inside a trace (its inputs are read on the host)."""
    Hk, Hv = q.shape[2], v.shape[2]
    qn, kn = (host_array(x).transpose(0, 2, 1, 3) for x in (q, k))  # [B, Hk, T, Dk]
    if Hv > Hk:
        qn, kn = np.repeat(qn, Hv // Hk, axis=1), np.repeat(kn, Hv // Hk, axis=1)
    vn = host_array(v).transpose(0, 2, 1, 3)  # [B, Hv, T, Dv]
    log_g = np.log(np.maximum(host_array(g), np.float32(1e-30))).transpose(0, 2, 1)
    bn = host_array(beta).transpose(0, 2, 1)  # [B, Hv, T]
    if mask is not None:
        keep = host_array(mask)[:, None, :] > 0
        log_g, bn = np.where(keep, log_g, 0.0), np.where(keep, bn, 0.0)
    s = np.array(host_array(state))  # [B, Hv, Dv, Dk], updated in place
    y = np.empty_like(vn)
    for start in range(0, vn.shape[2], CHUNK):
        part = slice(start, min(start + CHUNK, vn.shape[2]))
        y[:, :, part] = _chunk(
            qn[:, :, part], kn[:, :, part], vn[:, :, part], log_g[:, :, part], bn[:, :, part], s
        )
    if mask is not None:
        y *= keep[..., None]
    return mx.array(y.transpose(0, 2, 1, 3)).astype(v.dtype), mx.array(s)


def _chunk(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, log_g: np.ndarray, beta: np.ndarray, s: np.ndarray
) -> np.ndarray:
    """One chunk for every (batch, head): q,k `[B,H,C,Dk]`, v `[B,H,C,Dv]`, log_g, beta `[B,H,C]`;
    `s` `[B,H,Dv,Dk]` is the state before, overwritten with the state after. Returns y `[B,H,C,Dv]`."""
    C = q.shape[2]
    cum = np.cumsum(log_g, axis=-1)  # log gamma_t, the decay from the chunk's start through t
    ratio = np.exp(np.minimum(cum[..., :, None] - cum[..., None, :], 0.0))  # gamma_t / gamma_s, s <= t
    lower = np.tril(np.ones((C, C), dtype=bool), -1)
    gamma = np.exp(cum)[..., None]
    # (I + diag(beta) A) U = diag(beta) (V - diag(gamma) K S0^T), A[t, s] = ratio (k_t . k_s) for s < t
    system = np.where(lower, ratio * (k @ k.swapaxes(-1, -2)), 0.0) * beta[..., None]
    system += np.eye(C, dtype=np.float32)
    rhs = beta[..., None] * (v - gamma * (k @ s.swapaxes(-1, -2)))
    u = np.linalg.solve(system, rhs)  # [B, H, C, Dv]
    inclusive = np.tril(np.ones((C, C), dtype=bool))
    y = gamma * (q @ s.swapaxes(-1, -2)) + np.where(inclusive, ratio * (q @ k.swapaxes(-1, -2)), 0.0) @ u
    to_end = np.exp(cum[..., -1:] - cum)[..., None]  # gamma_C / gamma_s
    s *= np.exp(cum[..., -1])[..., None, None]
    s += u.swapaxes(-1, -2) @ (to_end * k)
    return y.astype(np.float32)
