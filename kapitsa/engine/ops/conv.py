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
    """`causal_conv_reference`, each output row summed in float32 over the K taps in order and
    rounded once to the input's dtype: a row's value does not depend on how many rows the call
    computes, so a verify's rows equal decode steps' bit for bit (greedy speculation writes what
    plain decoding writes in bf16 too). K shifted multiply-adds; under `mx.compile` one kernel."""
    K = weight.shape[1]
    T = conv_in.shape[1] - (K - 1)
    w = weight[:, :, 0].T.astype(mx.float32)  # [K, C]
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
