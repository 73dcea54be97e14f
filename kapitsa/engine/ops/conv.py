"""Causal depthwise conv1d over `concat(conv_state, new_rows)`, as GDN and Mamba-2 use it.

Weights use MLX's conv layout `[C, K, 1]` (`sanitize` moves Hugging Face's `[C, 1, K]`).
"""

from __future__ import annotations

import mlx.core as mx


def causal_conv_reference(conv_in: mx.array, weight: mx.array, bias: mx.array | None = None) -> mx.array:
    """conv_in `[B, K-1+T, C]` -> `[B, T, C]`: out[t] = sum_j conv_in[t+j] * w[:, j] (+ bias)."""
    K = weight.shape[1]
    T = conv_in.shape[1] - (K - 1)
    w = weight[:, :, 0].T  # [K, C]
    out = sum(conv_in[:, j : j + T] * w[j] for j in range(K))
    return out if bias is None else out + bias


def causal_conv(conv_in: mx.array, weight: mx.array, bias: mx.array | None = None) -> mx.array:
    """Same as `causal_conv_reference`; one multiply-add for a decode step, `mx.conv1d` otherwise."""
    K = weight.shape[1]
    if conv_in.shape[1] == K:  # T == 1: a dot product per channel beats a conv dispatch
        out = (conv_in * weight[:, :, 0].T).sum(axis=1, keepdims=True)
    else:
        out = mx.conv1d(conv_in, weight, groups=conv_in.shape[-1])
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
