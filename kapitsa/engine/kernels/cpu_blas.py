"""Large products on MLX's CPU backend through NumPy's BLAS: linears at prefill and in decode steps
of several rows, long attention.

MLX's Linux CPU build links the reference (netlib) BLAS and emulates bf16 arithmetic: on two
cores a [2048, 256] x [256, 768] product runs at ~2 GFLOP/s in float32 and ~0.3 GFLOP/s as a bf16
4-bit `quantized_matmul`, while NumPy's bundled OpenBLAS runs the same float32 product at
~80 GFLOP/s. A prompt's prefill is almost only such products, so on the CPU device they go
through NumPy on float32 copies; everything else (and every product inside an `mx.compile`
trace, where nothing may be evaluated) stays on MLX's ops, which are the reference
(tests/kernels/test_cpu_blas.py compares them).

MLX's CPU quantized product also costs each row a full pass of scalar dequantizing (a 16-row
product 16 one-row ones), so a decode step of several rows (KernelOptions.cpu_blas_rows) runs op
by op with its linears and tied head on the float32 copies, where every copy fits.

NumPy reads evaluated buffers, so only eager paths can use it: prefill chunks, long forwards and
those steps.
Inside an `mx.compile` trace the read raises (`host_array` turns that into `Traced`) and the
caller runs MLX's op instead, which the trace then records.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

MIN_ROWS = 17  # more tokens than any compiled step (models/base.py CHAIN_MAX_T) carries
# Rows from which a decode step on the CPU gains by running op by op with BLAS products over
# keeping its compiled trace of MLX's quantized products: a single row loses (the trace's saved
# dispatch outweighs the product), two rows already gain (lab/cpu_batch.py).
STEP_MIN_ROWS = 2
# query heads x rows x keys x head size (the QK product's multiply-adds) below which MLX's own attention
# costs less than reading its arrays here: the read waits for the layers before it (lab/runs/cpu-attention.log)
ATTENTION_MIN_WORK = 1 << 20
SCORE_BYTES = 64 << 20  # float32 scores one attention block may hold (all heads)


class Traced(Exception):
    """An input cannot be read on the host: the call is being traced (`mx.compile`, `vmap`)."""


def host_array(x: mx.array) -> np.ndarray:
    """x as float32 NumPy (evaluating it); raises `Traced` inside a function transformation."""
    try:
        return np.asarray(x.astype(mx.float32))
    except ValueError as err:
        if "transformation" in str(err) or "compile" in str(err):
            raise Traced from err
        raise


def on_cpu() -> bool:
    """Whether MLX computes on its CPU device (no GPU backend in use)."""
    return mx.default_device().type == mx.DeviceType.cpu


def takes_tokens(tokens: int) -> bool:
    """Whether a call over `tokens` tokens goes through BLAS here: more tokens than a compiled step
    carries, on the CPU device."""
    return tokens >= MIN_ROWS and on_cpu()


def takes_rows(x: mx.array) -> bool:
    """`takes_tokens` for a linear's input x `[..., tokens, features]` (or `[tokens, features]`)."""
    return takes_tokens(x.shape[-2] if x.ndim >= 3 else x.shape[0])


def takes_step_rows(x: mx.array, min_rows: int) -> bool:
    """Whether a linear that keeps its float32 copy takes input x `[batch, 1, features]` (a decode
    step's) through BLAS: at least `min_rows` rows (KernelOptions.cpu_blas_rows; 0: never), on the
    CPU. A verify's rows (T > 1) keep MLX's product, which gives each row the bits a one-row decode
    step's gets: greedy speculation then writes plain decoding's tokens."""
    return x.ndim >= 3 and x.shape[-2] == 1 and 0 < min_rows <= math.prod(x.shape[:-1]) and on_cpu()


def steps_by_blas(batch: int, T: int, min_rows: int) -> bool:
    """Whether a step of `batch` rows of `T` tokens runs op by op for `takes_step_rows`."""
    return T == 1 and 0 < min_rows <= batch and on_cpu()


@dataclass(slots=True)
class DenseCopy:
    """A linear's weight as float32 `[in, out]` (what `x @ W.T` reads), kept beside its source."""

    source: mx.array  # the layer's weight array this copy was made from
    weight_t: np.ndarray


def dense_weight_t(layer: nn.Module, *, keep: bool) -> np.ndarray:
    """`layer`'s weight as a float32 `[in, out]` array (dequantized for a quantized linear).

    `keep` holds the copy on the layer for later calls (re-made if the weight array is replaced).
    """
    weight = layer["weight"]
    held: DenseCopy | None = getattr(layer, "_blas_copy", None)
    if held is not None and held.source is weight:
        return held.weight_t
    if isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        dense = mx.dequantize(
            weight,
            layer["scales"],
            layer.get("biases"),
            group_size=layer.group_size,
            bits=layer.bits,
            mode=layer.mode,
        )
    else:
        dense = weight
    weight_t = np.ascontiguousarray(np.asarray(dense.astype(mx.float32)).T)
    if keep:
        object.__setattr__(layer, "_blas_copy", DenseCopy(weight, weight_t))
    return weight_t


def dense_bytes(layer: nn.Module) -> int:
    """Bytes of `layer`'s float32 dense copy."""
    out_features = layer["weight"].shape[0]
    in_features = layer["weight"].shape[1] * (
        32 // layer.bits if isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding)) else 1
    )
    return 4 * out_features * in_features


def matmul_t(x: mx.array, weight_t: np.ndarray) -> mx.array:
    """`x @ weight_t` for x `[..., in]` in float32 through BLAS; returned in x's dtype."""
    lead = x.shape[:-1]
    rows = host_array(x).reshape(-1, x.shape[-1])
    product = rows @ weight_t
    return mx.array(product.reshape(*lead, weight_t.shape[1])).astype(x.dtype)


def linear(layer: nn.Module, x: mx.array, *, keep: bool) -> mx.array | None:
    """`layer(x)` through BLAS (bias included); None inside a trace (the caller runs the layer's op)."""
    try:
        y = matmul_t(x, dense_weight_t(layer, keep=keep))
    except Traced:
        return None
    if "bias" in layer:
        y = y + layer["bias"]
    return y


def attention_takes(q: mx.array, k: mx.array, mask: object) -> bool:
    """Whether `attention` serves this call: CPU, enough work to pay, and no mask, a causal one or
    a bool `[B or 1, 1, T, L]` one (a batch of rows at different offsets, a draft tree).

    Decode steps and short verify chains count too: their attention runs eagerly (models/base.py
    `compiled_attention`), and over a long context MLX's CPU attention is the step's largest cost.
    """
    if not (mask is None or (isinstance(mask, str) and mask == "causal") or _row_mask(q, k, mask)):
        return False
    return on_cpu() and q.shape[1] * q.shape[2] * k.shape[2] * q.shape[3] >= ATTENTION_MIN_WORK


def _row_mask(q: mx.array, k: mx.array, mask: object) -> bool:
    return (
        isinstance(mask, mx.array)
        and mask.dtype == mx.bool_
        and mask.ndim == 4
        and mask.shape[0] in (1, q.shape[0])
        and mask.shape[1:] == (1, q.shape[2], k.shape[2])
    )


def attention(
    q: mx.array, k: mx.array, v: mx.array, *, scale: float, causal: bool, mask: mx.array | None = None
) -> mx.array:
    """(Raises `Traced` inside a trace.) Softmax attention of q `[B, H, T, D]` over k/v `[B, Hkv, L, D]` (H a multiple of Hkv),
    `causal` bottom-right aligned as in `mx.fast.scaled_dot_product_attention` (query t sees keys
    up to L - T + t), or `mask` (bool `[B or 1, 1, T, L]`, True: visible; every query sees a key).
    Float32 throughout; returned `[B, H, T, D]` in q's dtype."""
    B, H, T, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    group = H // Hkv
    qn = host_array(q).reshape(B, Hkv, group, T, D)
    kn, vn = host_array(k), host_array(v)
    allowed = None if mask is None else np.broadcast_to(np.asarray(mask), (B, 1, T, L))
    out = np.empty((B, Hkv, group, T, D), dtype=np.float32)
    block = max(1, SCORE_BYTES // (4 * H * L))
    for b in range(B):
        for start in range(0, T, block):
            stop = min(start + block, T)
            rows = None if allowed is None else allowed[b, 0, start:stop]
            visible = _visible_keys(rows, L - T + stop if causal else L)
            out[b, :, :, start:stop] = _block(
                qn[b, :, :, start:stop],
                kn[b, :, :visible],
                vn[b, :, :visible],
                scale,
                L - T + start,
                causal and rows is None,
                None if rows is None else rows[:, :visible],
            )
    return mx.array(out.reshape(B, H, T, D)).astype(q.dtype)


def _visible_keys(rows: np.ndarray | None, default: int) -> int:
    """Keys up to the last one any query of the block sees (a shorter row of a batch reads less)."""
    if rows is None:
        return default
    seen = np.flatnonzero(rows.any(axis=0))
    return int(seen[-1]) + 1 if seen.size else 1


def _block(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    scale: float,
    first_position: int,
    causal: bool,
    allowed: np.ndarray | None = None,
) -> np.ndarray:
    """One query block: q `[Hkv, G, Tb, D]`, k/v `[Hkv, Lb, D]`; query i sits at `first_position + i`;
    `allowed` `[Tb, Lb]`, when given, is the block's mask."""
    scores = (q * np.float32(scale)) @ k[:, None].swapaxes(-1, -2)  # [Hkv, G, Tb, Lb]
    if causal:  # only the block's own trailing keys can lie after a query
        tail = scores[..., first_position:]
        tail[..., np.triu(np.ones(tail.shape[-2:], dtype=bool), 1)] = -np.inf
    if allowed is not None:
        scores[..., ~allowed] = -np.inf
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    total = scores.sum(axis=-1, keepdims=True)
    return (scores @ v[:, None]) / total
