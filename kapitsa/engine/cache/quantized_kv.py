"""Quantized K/V for attention layers: 8 or 4 bits per element, a scale and a bias per group.

Each new K/V row is quantized once, when it is written (`mx.quantize` along the head dimension), so
a token's stored K/V does not depend on how it arrived (prefill chunk, decode step, verify chain,
draft tree): speculative and batched decoding see the same values as plain decoding. Attention runs
on the quantized buffers directly with `mx.quantized_matmul` (as mlx-lm's QuantizedKVCache does):
scores = q · dequant(K)ᵀ and out = softmax(scores) · dequant(V), never materialising a float K/V.

A layer's state is six arrays with the token axis at 2 (`slots`): K's packed words, scales and
biases, then V's. The prefix cache and the disk tier store those arrays as they are.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from kapitsa.engine import kernels, options
from kapitsa.engine.cache.layers import KV_STEP, KVCache, StepInfo
from kapitsa.engine.ops import device_queue

KV_BITS = (8, 4)
_GROUP_SIZES = (64, 32)  # the largest MLX supports that divides the head size: fewer scales per row

QuantizedKV = tuple[mx.array, mx.array, mx.array]  # packed uint32 words, scales, biases


def kv_group_size(head_dim: int) -> int:
    """Elements per scale/bias group for a head of `head_dim`; ValueError when none divides it."""
    for size in _GROUP_SIZES:
        if head_dim % size == 0:
            return size
    raise ValueError(
        f"a head of {head_dim} cannot be quantized in groups of {' or '.join(map(str, _GROUP_SIZES))}"
    )


def quantized_bytes_per_row(head_dim: int, bits: int, scale_bytes: int) -> int:
    """Bytes one token of one head takes in K (or V): packed words plus a scale and bias per group."""
    return head_dim * bits // 8 + 2 * (head_dim // kv_group_size(head_dim)) * scale_bytes


class QuantizedKVCache(KVCache):
    """`KVCache` whose `keys` and `values` are `(words, scales, biases)` of `[B, Hkv, capacity, *]`.

    Args:
        n_kv_heads, head_dim: the layer's K/V shape.
        bits: 8 or 4.
    """

    has_tail = False  # rows are quantized as written; the decode kernel reads none of these

    def __init__(self, n_kv_heads: int, head_dim: int, *, bits: int):
        if bits not in KV_BITS:
            raise ValueError(f"KV bits must be one of {KV_BITS}, not {bits}")
        super().__init__(n_kv_heads, head_dim)
        self.bits = bits
        self.group_size = kv_group_size(head_dim)
        self.keys: QuantizedKV | None = None  # type: ignore[assignment]
        self.values: QuantizedKV | None = None  # type: ignore[assignment]

    def empty_like(self) -> QuantizedKVCache:
        return QuantizedKVCache(self.n_kv_heads, self.head_dim, bits=self.bits)

    def slots(self) -> tuple[mx.array, ...]:
        return () if self.keys is None or self.values is None else (*self.keys, *self.values)

    def set_slots(self, arrays: Sequence[mx.array]) -> None:
        arrays = tuple(arrays)
        self.keys, self.values = (arrays[:3], arrays[3:]) if arrays else (None, None)  # type: ignore[assignment]

    def eval_arrays(self) -> tuple[mx.array, ...]:
        return self.slots()

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.slots())

    def bytes_per_token(self, dtype: mx.Dtype) -> int:
        return 2 * self.n_kv_heads * quantized_bytes_per_row(self.head_dim, self.bits, dtype.size)

    def update(self, k: mx.array, v: mx.array, info: StepInfo) -> tuple[QuantizedKV, QuantizedKV]:  # type: ignore[override]
        """Quantize and write `k, v [B, Hkv, T, D]` at each row's offset; return the quantized
        keys/values to attend (see `attention`)."""
        B, _, T, _ = k.shape
        self._reserve_quantized(B, info.kv_len, k.dtype)
        new_k = mx.quantize(k, group_size=self.group_size, bits=self.bits)
        new_v = mx.quantize(v, group_size=self.group_size, bits=self.bits)
        if info.uniform_offsets:
            start = mx.array([info.offsets[0]])
            self.keys = tuple(
                mx.slice_update(a, n, start, (2,)) for a, n in zip(self.keys, new_k, strict=True)
            )
            self.values = tuple(
                mx.slice_update(a, n, start, (2,)) for a, n in zip(self.values, new_v, strict=True)
            )
        else:
            pos = (mx.array(info.offsets)[:, None] + mx.arange(T))[:, None, :, None]
            self.keys = tuple(
                mx.put_along_axis(a, pos, n, axis=2) for a, n in zip(self.keys, new_k, strict=True)
            )
            self.values = tuple(
                mx.put_along_axis(a, pos, n, axis=2) for a, n in zip(self.values, new_v, strict=True)
            )
        end = info.kv_len
        return tuple(a[:, :, :end] for a in self.keys), tuple(a[:, :, :end] for a in self.values)  # type: ignore[return-value]

    def attention(
        self, q: mx.array, keys: QuantizedKV, values: QuantizedKV, info: StepInfo, *, scale: float
    ) -> mx.array:
        """Attention of q `[B, H, T, D]` over what `update` returned, with the step's mask; `[B, T, H*D]`."""
        out = quantized_attention(
            q, keys, values, info.attention_mask, scale=scale, group_size=self.group_size, bits=self.bits
        )
        B, _, T, _ = q.shape
        return out.transpose(0, 2, 1, 3).reshape(B, T, -1)

    def _reserve_quantized(self, batch: int, needed: int, dtype: mx.Dtype) -> None:
        have = 0 if self.keys is None else self.keys[0].shape[2]
        if needed <= have:
            return
        grow = -(-(needed - have) // KV_STEP) * KV_STEP
        words = self.head_dim * self.bits // 32
        groups = self.head_dim // self.group_size
        shapes = ((words, mx.uint32), (groups, dtype), (groups, dtype))
        pads = [tuple(mx.zeros((batch, self.n_kv_heads, grow, n), t) for n, t in shapes) for _ in range(2)]
        if self.keys is None:
            self.keys, self.values = pads
            return
        self.keys = tuple(mx.concatenate([a, p], axis=2) for a, p in zip(self.keys, pads[0], strict=True))
        self.values = tuple(mx.concatenate([a, p], axis=2) for a, p in zip(self.values, pads[1], strict=True))


def quantized_attention(
    q: mx.array,
    keys: QuantizedKV,
    values: QuantizedKV,
    mask: mx.array | str | None,
    *,
    scale: float,
    group_size: int,
    bits: int,
    dequantize_first: bool | None = None,
) -> mx.array:
    """Softmax attention of q `[B, H, T, D]` over quantized K/V `[B, Hkv, L, *]` (H a multiple of
    Hkv); `mask` as `mx.fast.scaled_dot_product_attention` takes it ("causal" is bottom-right
    aligned, a bool array `[B, 1, T, L]` marks visible keys). Returns `[B, H, T, D]` in q's dtype.

    The scores are materialised, so a long prefill chunk over a long context runs in blocks of
    query positions whose scores stay under `options.SCORES_BLOCK_BYTES` (each row's softmax is
    its own, so the blocks give the same values).

    `dequantize_first` (None: where MLX's quantized matmul cannot take these operands, i.e. on
    CUDA, whose kernels need an unbatched weight of 8-aligned rows and have no transposed-input
    form for the V product) dequantizes one layer's K and V to q's dtype once and attends with
    plain matmuls: the same quantized values, one layer's float K/V held for the call.
    """
    B, H, T, D = q.shape
    L = keys[0].shape[2]
    if dequantize_first is None:
        dequantize_first = kernels.backend() == "cuda"
    operands: tuple = (keys, values)
    if dequantize_first:
        operands = tuple(
            mx.dequantize(*kv, group_size=group_size, bits=bits).astype(q.dtype) for kv in operands
        )
    keys_, values_ = operands
    rows = max(1, options.SCORES_BLOCK_BYTES // (B * H * L * 4))
    if rows >= T:
        return _attention_block(q, keys_, values_, _block_mask(mask, L, T, 0, T), scale, group_size, bits)
    blocks = []
    for start in range(0, T, rows):
        stop = min(start + rows, T)
        block_mask = _block_mask(mask, L, T, start, stop)
        out = _attention_block(q[:, :, start:stop], keys_, values_, block_mask, scale, group_size, bits)
        # one block's scores at a time: a lazy graph holds every block's at once
        device_queue.eval_unless_traced(out)
        blocks.append(out)
    return mx.concatenate(blocks, axis=2)


def _block_mask(mask: mx.array | str | None, L: int, T: int, start: int, stop: int) -> mx.array | None:
    """Query rows [start, stop) of the mask: bool `[stop-start, L]` or `[B, 1, stop-start, L]`, or None."""
    if isinstance(mask, str):
        return (mx.arange(L - T + start, L - T + stop)[:, None] >= mx.arange(L)[None]) if T > 1 else None
    if mask is None or (start == 0 and stop == T):
        return mask
    return mask[..., start:stop, :]


def _attention_block(
    q: mx.array,
    keys: QuantizedKV | mx.array,
    values: QuantizedKV | mx.array,
    mask: mx.array | None,
    scale: float,
    group_size: int,
    bits: int,
) -> mx.array:
    """One block of query rows; `keys`/`values` quantized triples or (dequantize_first) arrays
    `[B, Hkv, L, D]`."""
    B, H, T, D = q.shape
    dequantized = isinstance(keys, mx.array)
    Hkv = keys.shape[1] if dequantized else keys[0].shape[1]
    group = H // Hkv
    qg = (q * scale).reshape(B, Hkv, group, T, D)
    if dequantized:
        # the group's query rows stacked, so each K/V head is read as it is, not broadcast
        scores = (qg.reshape(B, Hkv, group * T, D) @ keys.swapaxes(-1, -2)).reshape(B, Hkv, group, T, -1)
    else:
        kg = tuple(mx.expand_dims(a, 2) for a in keys)
        scores = mx.quantized_matmul(qg, *kg, transpose=True, group_size=group_size, bits=bits)
    if mask is not None:
        visible = mask if mask.ndim == 2 else mx.expand_dims(mask, 2)  # [B, 1, 1, T, L] over the groups
        scores = mx.where(visible, scores, mx.array(-mx.inf, scores.dtype))
    weights = mx.softmax(scores.astype(mx.float32), axis=-1).astype(q.dtype)
    if dequantized:
        out = weights.reshape(B, Hkv, group * T, -1) @ values
    else:
        vg = tuple(mx.expand_dims(a, 2) for a in values)
        out = mx.quantized_matmul(weights, *vg, transpose=False, group_size=group_size, bits=bits)
    return out.reshape(B, H, T, D)


def quantize_kv_layers(layers: list, bits: int | None) -> list:
    """The layer caches with every full-attention `KVCache` replaced by a `QuantizedKVCache` of
    `bits` (None: unchanged). Other kinds (recurrent, sliding windows) stay as they are."""
    if bits is None:
        return layers
    return [
        QuantizedKVCache(c.n_kv_heads, c.head_dim, bits=bits) if type(c) is KVCache else c for c in layers
    ]


def use_kv_bits(model, bits: int | None) -> None:  # noqa: ANN001 - a HybridLM
    """Make the model's `make_cache` store attention K/V at `bits` (8 or 4; None: unquantized).

    Raises:
        ValueError: `bits` is not 8 or 4, or an attention layer's head size cannot be grouped.
    """
    if bits is not None:
        if bits not in KV_BITS:
            raise ValueError(f"KV bits must be one of {KV_BITS}, not {bits}")
        model.kv_bits = bits
        model.make_cache(1)  # a head size MLX cannot quantize fails here, not at the first request
    else:
        model.kv_bits = None


def slot_count(layer: KVCache) -> int:
    """Arrays per attention layer in a prefix-cache KV payload (see `KVCache.slots`)."""
    return 6 if isinstance(layer, QuantizedKVCache) else 2
