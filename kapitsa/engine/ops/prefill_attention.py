"""Prefill attention over head sizes MLX has no fused kernel for, run in blocks of query rows.

MLX's fused attention takes a prefill (more than 8 query tokens) only at some head sizes: Metal's
`sdpa_full` 64, 80 and 128, CUDA's 64, 96 and 128 (mlx/backend/*/scaled_dot_product_attention).
At other sizes (Qwen3.5's 256) `mx.fast.scaled_dot_product_attention` composes matmul, softmax and
matmul, which materialise a chunk's scores: query heads x chunk x context in the activation dtype,
12.9 GB for a 27B's 2048-token chunk at a 128k context, more than a 16 GB Mac has. Here such a call
runs in blocks of query rows whose scores stay under SCORES_BLOCK_BYTES. A causal block attends
only over the keys its rows may see (the first L - T + stop: bottom-right aligned, as the whole
call is), and each block is sent to the device and the one before it waited for, so at most two
blocks' scores are alive (a backend keeps an op's buffers until the command buffer holding it
completes). Each row's softmax is its own: the blocks give the one call's values.
"""

from __future__ import annotations

import mlx.core as mx

from kapitsa.engine.kernels import backend
from kapitsa.engine.ops import device_queue
from kapitsa.engine.options import SCORES_BLOCK_BYTES

FUSED_PREFILL_HEAD_DIMS = {"metal": (64, 80, 128), "cuda": (64, 96, 128)}
VECTOR_MAX_QUERIES = 8  # up to this many query rows take MLX's vector kernel (no scores materialised)


def block_rows(q: mx.array, k: mx.array, block_bytes: int = SCORES_BLOCK_BYTES) -> int | None:
    """Query rows per block for `attention_in_blocks`, or None where one call is right: the CPU
    (its own route, kernels/cpu_blas.py), a fused head size, a short query, or scores that fit."""
    name = backend()
    if name is None:
        return None
    B, H, T, D = q.shape
    if T <= VECTOR_MAX_QUERIES or D in FUSED_PREFILL_HEAD_DIMS.get(name, ()):
        return None
    row_bytes = B * H * k.shape[2] * q.dtype.size
    rows = max(1, block_bytes // max(1, row_bytes))
    return None if rows >= T else rows


def attention_in_blocks(
    q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask: mx.array | str | None, rows: int
) -> mx.array:
    """`mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)` over blocks of
    `rows` query rows; q `[B, H, T, D]`, k/v `[B, Hkv, L, D]`, `mask` "causal" (bottom-right
    aligned), a mask array whose query axis is T or 1, or None."""
    T, L = q.shape[2], k.shape[2]
    blocks: list[mx.array] = []
    sent: mx.array | None = None
    for start in range(0, T, rows):
        stop = min(start + rows, T)
        block = _block(q[:, :, start:stop], k, v, scale, mask, start, stop, T, L)
        sent = device_queue.send(block, sent)
        blocks.append(block)
    return mx.concatenate(blocks, axis=2)


def _block(q, k, v, scale: float, mask, start: int, stop: int, T: int, L: int) -> mx.array:  # noqa: ANN001
    if isinstance(mask, str):  # "causal": these rows see the first L - T + stop keys, aligned as a whole call
        seen = L - T + stop
        return mx.fast.scaled_dot_product_attention(q, k[:, :, :seen], v[:, :, :seen], scale=scale, mask=mask)
    if mask is not None and mask.shape[-2] == T:
        mask = mask[..., start:stop, :]
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
