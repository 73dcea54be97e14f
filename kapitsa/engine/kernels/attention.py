"""Decode attention on CUDA where MLX has no fast kernel for the head size (Qwen3.5's 256).

MLX 0.32's CUDA `scaled_dot_product_attention` has fast paths for head dims 64, 96 and 128 only
(mlx/backend/cuda/scaled_dot_product_attention.cu, `supports_sdpa_vector`; cuDNN up to 128), so a
Qwen3.5 decode step's attention falls back to matmul + softmax + matmul with the GQA reshapes:
about ten primitives per attention layer, each ~3-5 us of host time on that backend
(lab/host_costs.py). Here it is two kernels, flash-decoding style, for one query token per row:
1. cuda_src/attn_partial.cu: block (row, kv head, split of the keys) runs an online softmax for
   the query heads sharing that kv head, its warps' results merged into one partial (max, sum,
   weighted values) per query head and split.
2. cuda_src/attn_combine.cu: block (row, query head, 32-wide slice of the head) merges the
   partials and writes the output as `[B, 1, Hq * D]`, times sigmoid(gate) for gated attention,
   ready for the output projection.
The keys come from two buffers: the cache's (its first `committed` rows) and a tail of the rows
written since (cache/layers.py keeps one so that a decode step's write copies a few hundred rows,
not the whole cache). Each row has its own number of valid keys and split point (a server's batch
holds conversations at different positions), and they, the buffers' capacities and the split count
are runtime inputs, so neither a growing KV cache nor another split count recompiles (`splits_for`
picks the count; a caller may name one). `decode_attention_reference` is the same computation in
MLX ops.

Kernel family "attn" (on by default on CUDA); used only after `probe()` passed (the layers run it
before their first compiled decode step): a kernel's errors surface only when a graph is
evaluated, in the middle of a forward.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import mlx.core as mx

from kapitsa.engine.kernels import backend, float_bits
from kapitsa.engine.kernels.cuda import CudaKernel, read_cuda_source

MLX_FAST_HEAD_DIMS = (64, 96, 128)  # MLX's own CUDA kernels take these: nothing to gain
MAX_REPEATS = 8  # query heads per kv head (registers: NREP * D / 16 floats per lane)
MAX_HEAD_DIM = 256
WARPS = 4
# Key splits per (row, kv head): enough partial blocks at batch 1 (TARGET_BLOCKS over the kv heads)
# to keep every SM streaming keys, since a decode step's attention calls run one after another
# (each layer waits for the one before). The count does not depend on the batch size, so a row's
# attention sums in the same order alone and in any batch (larger batches only get more blocks). A warp walks its keys one after another, each a
# dependent chain of loads and shuffles, so few blocks leave the call latency-bound: alone on an
# H100 (lab/kv_step_cost.py), the 4B's batch-1 call over 8k keys took 193-205 us at 16 splits and
# 145 at 128, over 32k keys 632 against 203-221. Never fewer than MIN_KEYS_PER_SPLIT keys a split,
# so a short context gets fewer and no split is left without keys.
TARGET_BLOCKS = 512
MIN_KEYS_PER_SPLIT = 32
MAX_SPLITS = 128
DTYPES = (mx.bfloat16, mx.float16, mx.float32)
WORKING: dict[str, bool] = {}  # "attn" -> whether the kernels passed their probe in this process
_log = logging.getLogger(__name__)

_PARTIAL = CudaKernel(
    name="kapitsa_attn_partial",
    input_names=("q", "k", "v", "tk", "tv", "meta"),
    output_names=("part_o", "part_ml"),
    source=read_cuda_source("attn_partial.cu"),
)
_COMBINE = CudaKernel(
    name="kapitsa_attn_combine",
    input_names=("part_o", "part_ml", "gate"),
    output_names=("out",),
    source=read_cuda_source("attn_combine.cu"),
)


def supports(q: mx.array, keys: mx.array, values: mx.array) -> bool:
    """q `[B, Hq, 1, D]`, keys/values the cache's whole buffers `[B, Hkv, capacity, D]`."""
    if backend() != "cuda" or q.ndim != 4 or keys.ndim != 4 or keys.shape != values.shape:
        return False
    B, hq, T, D = q.shape
    hkv = keys.shape[1]
    return (
        T == 1
        and keys.shape[0] == B
        and keys.shape[3] == D
        and D not in MLX_FAST_HEAD_DIMS
        and D % 32 == 0
        and D <= MAX_HEAD_DIM
        and hq % hkv == 0
        and hq // hkv <= MAX_REPEATS
        and q.dtype in DTYPES
        and keys.dtype == values.dtype == q.dtype
    )


def usable(q: mx.array, keys: mx.array, values: mx.array) -> bool:
    """`supports` and the probe passed."""
    return WORKING.get("attn", False) and supports(q, keys, values)


def probe() -> bool:
    """Run the kernels once against the reference where they can apply (CUDA); idempotent.
    Call it outside any compiled trace: it evaluates."""
    if "attn" in WORKING or backend() != "cuda":
        return WORKING.get("attn", False)
    keys = mx.random.split(mx.random.key(5), 4)
    q = mx.random.normal((1, 8, 1, 256), key=keys[0]).astype(mx.bfloat16)
    k = mx.random.normal((1, 2, 64, 256), key=keys[1]).astype(mx.bfloat16)
    v = mx.random.normal((1, 2, 64, 256), key=keys[2]).astype(mx.bfloat16)
    gate = mx.random.normal((1, 1, 8 * 256), key=keys[3]).astype(mx.bfloat16)
    tail = (k[:, :, 32:] + 1, v[:, :, 32:] - 1)  # keys 20..36 from a tail of its own
    try:
        ok = True
        two_rows = (  # a batch at two positions: each row its own keys and split point
            [mx.concatenate([a, b]) for a, b in ((q, -q), (k, v), (v, k), (gate, gate))],
            {"tail": tuple(mx.concatenate([t, t[:, ::-1]]) for t in tail), "committed": [20, 9]},
            [37, 25],
        )
        for (q_, k_, v_, g_), extra, length in (
            ((q, k, v, gate), {}, 37),
            ((q, k, v, gate), {"tail": tail, "committed": 20}, 37),
            two_rows,
        ):
            got = decode_attention(q_, k_, v_, length, scale=1 / 16, gate=g_, **extra).astype(mx.float32)
            ref = decode_attention_reference(q_, k_, v_, length, scale=1 / 16, gate=g_, **extra)
            ok = ok and bool(mx.allclose(got, ref.astype(mx.float32), atol=3e-2, rtol=3e-2).item())
        WORKING["attn"] = ok
    except (RuntimeError, ValueError) as exc:
        _log.warning("decode attention kernel unavailable, using MLX's attention: %s", exc)
        WORKING["attn"] = False
    if not WORKING["attn"]:
        _log.warning("decode attention kernel disagrees with the reference; using MLX's attention")
    return WORKING["attn"]


def splits_for(length: int, kv_heads: int = 1) -> int:
    """Key splits for a decode step over `length` keys with `kv_heads` kv heads (any batch size)."""
    wanted = min(MAX_SPLITS, -(-TARGET_BLOCKS // max(kv_heads, 1)))
    return max(1, min(wanted, length // MIN_KEYS_PER_SPLIT))


@functools.cache
def _templates(dtype, D: int, nrep: int, hq: int, scale: float, gated: bool) -> tuple[tuple, tuple]:
    partial = (("T", dtype), ("D", D), ("NREP", nrep), ("SCALE_BITS", float_bits(scale)))
    combine = (("T", dtype), ("D", D), ("HQ", hq), ("MAX_P", MAX_SPLITS), ("GATE", gated))
    return partial, combine


Span = int | Sequence[int]  # one value for every row, or one per row


def decode_attention(
    q: mx.array,
    keys: mx.array,
    values: mx.array,
    length: Span,
    *,
    scale: float,
    gate: mx.array | None = None,
    splits: int | None = None,
    tail: tuple[mx.array, mx.array] | None = None,
    committed: Span | None = None,
) -> mx.array:
    """softmax(q K^T * scale) V over `length` keys, for one query token per row -> `[B, 1, Hq * D]`
    in q's dtype (times sigmoid(gate), gate `[B, 1, Hq * D]`). The keys are the first `length`
    positions of the buffers, or with `tail` (its keys and values, `[B, Hkv, capacity, D]`) the
    buffers' first `committed` positions, then the tail's first `length - committed`. `length` and
    `committed` are one count for every row or one per row.
    `splits`: the key splits per (row, kv head), 1 to MAX_SPLITS (default: `splits_for` of the
    longest row). Callers check `supports`."""
    B, hq, _, D = q.shape
    hkv, cap = keys.shape[1], keys.shape[2]
    _check_tail(keys, tail, committed)
    tail_keys, tail_values = (keys, values) if tail is None else tail  # without one: unread
    split_at, tail_cap = (length, None) if tail is None else (committed, tail_keys.shape[2])
    if isinstance(length, int) and isinstance(split_at, int):  # every row alike: the common step
        _check_span(length, split_at, cap, tail_cap)
        spans, longest = [0, length, split_at], length  # stride 0: one span for every row
    else:
        lengths, split_points = per_row(length, B, "length"), per_row(split_at, B, "committed")
        _check_rows(lengths, split_points, cap, tail_cap)
        spans = [2] + [0] * (2 * B)  # stride 2: (L, P) of each row
        spans[1::2], spans[2::2] = lengths, split_points
        longest = max(lengths)
    splits = splits_for(longest, hkv) if splits is None else splits
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"splits must lie between 1 and {MAX_SPLITS}, got {splits}")
    partial, combine = _templates(q.dtype, D, hq // hkv, hq, float(scale), gate is not None)
    # (cap, S, tail cap, Hkv, span stride, then (L, P) per row or once): one array a call
    meta = mx.array([cap, splits, tail_keys.shape[2], hkv, *spans], dtype=mx.int32)
    part_o, part_ml = _PARTIAL(
        [q, keys, values, tail_keys, tail_values, meta],
        template=partial,
        grid=(B * hkv * splits * WARPS * 32, 1, 1),
        threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(B * hq, splits, D), (B * hq, splits, 2)],
        output_dtypes=[mx.float32, mx.float32],
    )
    return _COMBINE(
        [part_o, part_ml, part_o if gate is None else gate],  # the gate is unread without GATE
        template=combine,
        grid=(B * hq * D, 1, 1),  # a warp per (row, query head, 32 values of the head)
        threadgroup=(32, 1, 1),
        output_shapes=[(B, 1, hq * D)],
        output_dtypes=[q.dtype],
    )[0]


def per_row(value: Span, rows: int, name: str) -> list[int]:
    """`value` as one int per row."""
    if isinstance(value, int):
        return [value] * rows
    values = [int(v) for v in value]
    if len(values) != rows:
        raise ValueError(f"{name}: one value per row ({rows}), got {len(values)}")
    return values


def _check_tail(keys: mx.array, tail: tuple[mx.array, mx.array] | None, committed: Span | None) -> None:
    if tail is None:
        return
    if committed is None:
        raise ValueError("a tail needs `committed`, the buffers' rows before it")
    tail_keys = tail[0]
    same = tail_keys.shape[:2] == keys.shape[:2] and tail_keys.shape[3] == keys.shape[3]
    if not same or tail_keys.dtype != keys.dtype or tail[1].shape != tail_keys.shape:
        raise ValueError(
            f"the tail {tail_keys.shape} {tail_keys.dtype} does not match the buffers {keys.shape}"
        )


def _check_rows(lengths: list[int], split_points: list[int], cap: int, tail_cap: int | None) -> None:
    """`_check_span` for every row, in one pass where all are in bounds (a batch's every step)."""
    if tail_cap is None:
        if min(lengths) >= 1 and max(lengths) <= cap:
            return
    else:
        rows = zip(lengths, split_points, strict=True)
        if all(0 <= c <= cap and n >= 1 and c <= n <= c + tail_cap for n, c in rows):
            return
    for n, c in zip(lengths, split_points, strict=True):
        _check_span(n, c, cap, tail_cap)  # raises for the first row out of bounds


def _check_span(length: int, committed: int | None, cap: int, tail_cap: int | None) -> None:
    """One row's keys: `length` of them from buffers of `cap` positions, or with a tail of
    `tail_cap` positions, the buffers' first `committed` then the tail's."""
    if tail_cap is None:
        if not 1 <= length <= cap:
            raise ValueError(f"length must lie between 1 and the buffer's {cap} positions, got {length}")
        return
    if not 0 <= committed <= min(length, cap):
        raise ValueError(f"committed must lie between 0 and {min(length, cap)}, got {committed}")
    if not 1 <= length <= committed + tail_cap:
        room = committed + tail_cap
        raise ValueError(f"length must lie between 1 and the buffers' {room} positions, got {length}")


def decode_attention_reference(
    q: mx.array,
    keys: mx.array,
    values: mx.array,
    length: Span,
    *,
    scale: float,
    gate: mx.array | None = None,
    tail: tuple[mx.array, mx.array] | None = None,
    committed: Span | None = None,
) -> mx.array:
    """What `decode_attention` computes, in MLX ops (the model's own path); rows of different
    lengths one at a time."""
    B, hq, T, _ = q.shape
    lengths = per_row(length, B, "length")
    commits = None if committed is None else per_row(committed, B, "committed")
    if len(set(lengths)) > 1 or (commits is not None and len(set(commits)) > 1):
        rows = [
            decode_attention_reference(
                q[b : b + 1], keys[b : b + 1], values[b : b + 1], lengths[b], scale=scale,
                gate=None if gate is None else gate[b : b + 1],
                tail=None if tail is None else (tail[0][b : b + 1], tail[1][b : b + 1]),
                committed=None if commits is None else commits[b],
            )
            for b in range(B)
        ]  # fmt: skip
        return mx.concatenate(rows, axis=0)
    keys, values = keys_read(
        keys, values, lengths[0], tail=tail, committed=None if commits is None else commits[0]
    )
    out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=None)
    out = out.transpose(0, 2, 1, 3).reshape(B, T, -1)
    return out if gate is None else out * mx.sigmoid(gate)


def keys_read(
    keys: mx.array,
    values: mx.array,
    length: int,
    *,
    tail: tuple[mx.array, mx.array] | None = None,
    committed: int | None = None,
) -> tuple[mx.array, mx.array]:
    """The `length` keys and values `decode_attention` reads, as one `[B, Hkv, length, D]` pair."""
    if tail is None:
        return keys[:, :, :length], values[:, :, :length]
    rest = length - committed
    return (
        mx.concatenate([keys[:, :, :committed], tail[0][:, :, :rest]], axis=2),
        mx.concatenate([values[:, :, :committed], tail[1][:, :, :rest]], axis=2),
    )
