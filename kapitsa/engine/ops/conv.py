"""Causal depthwise conv1d over `concat(conv_state, new_rows)`, as GDN and Mamba-2 use it.

Weights use MLX's conv layout `[C, K, 1]` (`sanitize` moves Hugging Face's `[C, 1, K]`).
"""

from __future__ import annotations

import mlx.core as mx

from kapitsa.engine.kernels import cpu_blas


def causal_conv_reference(conv_in: mx.array, weight: mx.array, bias: mx.array | None = None) -> mx.array:
    """conv_in `[B, K-1+T, C]` -> `[B, T, C]`: out[t] = sum_j conv_in[t+j] * w[:, j] (+ bias)."""
    K = weight.shape[1]
    T = conv_in.shape[1] - (K - 1)
    w = weight[:, :, 0].T  # [K, C]
    out = sum(conv_in[:, j : j + T] * w[j] for j in range(K))
    return out if bias is None else out + bias


# Up to this many tokens (decode steps and speculative verifies) the rows are one reduction over
# the K taps of a strided window view: a primitive whose per-row arithmetic does not depend on the
# row count, so a verify's rows equal decode steps' bit for bit. Longer calls (prefill) need not
# match them: on the CPU they add the K shifted products in float32 (the same bits as the reduction
# there, a sequential float32 sum from tap 0; 3-4x faster than `mx.conv1d`, whose CPU depthwise
# kernel is slow), on a GPU they keep `mx.conv1d`, one kernel.
SHORT_CONV_TOKENS = 16


def causal_conv(conv_in: mx.array, weight: mx.array, bias: mx.array | None = None) -> mx.array:
    """`causal_conv_reference`. Up to SHORT_CONV_TOKENS rows (and any count on the CPU), each row
    summed in float32 over the K taps in order and rounded once to the input's dtype, so a row's
    value does not depend on how many rows the call computes."""
    K = weight.shape[1]
    B, L, C = conv_in.shape
    T = L - (K - 1)
    if T > SHORT_CONV_TOKENS and not cpu_blas.on_cpu():
        out = mx.conv1d(conv_in, weight, groups=C)
        return out if bias is None else out + bias
    w = weight[:, :, 0].T.astype(mx.float32)  # [K, C]
    if T <= SHORT_CONV_TOKENS:
        windows = mx.as_strided(mx.contiguous(conv_in), (B, T, K, C), (L * C, C, C, 1))
        out = (windows.astype(mx.float32) * w).sum(axis=2)
    else:
        out = conv_in[:, :T].astype(mx.float32) * w[0]
        for j in range(1, K):
            out = out + conv_in[:, j : j + T].astype(mx.float32) * w[j]
    out = out.astype(conv_in.dtype)
    return out if bias is None else out + bias


def conv_state_after(conv_in: mx.array, kept: list[int] | None, kernel: int) -> mx.array:
    """The K-1 conv rows that follow `kept[b]` of the new tokens (all of them when `kept` is None).

    conv_in is `[B, K-1+T, C]`; row `kept[b] + j` is the j-th row of the window that ends right
    after token `kept[b] - 1`, so the state is exactly what decoding only those tokens leaves.
    """
    n_keep = kernel - 1
    if kept is None:
        return mx.contiguous(conv_in[:, conv_in.shape[1] - n_keep :])
    if len(set(kept)) == 1:
        return mx.contiguous(conv_in[:, kept[0] : kept[0] + n_keep])
    starts = mx.array(kept, dtype=mx.int32)[:, None] + mx.arange(n_keep)
    return mx.take_along_axis(conv_in, starts[..., None], axis=1)
