"""Dequantizing GGML tensor data to float32 numpy arrays.

Q8_0, Q4_K and Q6_K (the common llama.cpp quantizations) are decoded here, vectorized over
blocks, following ggml's reference `dequantize_row_*`; other types go through the `gguf`
package's reference decoder. F32/F16/BF16 are plain reinterpretations.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

QK_K = 256  # values per K-quant super-block


def _blocks(data: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, tuple[int, ...]]:
    """Raw bytes as [n_blocks, block_bytes], plus the logical (numpy-order) shape of the values."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    raw = np.ascontiguousarray(data).view(np.uint8)
    shape = (*raw.shape[:-1], raw.shape[-1] // type_size * block_size)
    return raw.reshape(-1, type_size), shape


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def dequantize_q8_0(blocks: np.ndarray) -> np.ndarray:
    """Block: f16 scale d, then 32 int8 q. Value = d * q."""
    d = _f16(blocks[:, :2])
    q = blocks[:, 2:].view(np.int8).astype(np.float32)
    return d * q


def _k4_scales_and_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins of a Q4_K/Q5_K super-block, from its 12 packed bytes."""
    p = packed.astype(np.uint8)
    scales = np.empty((p.shape[0], 8), np.uint8)
    mins = np.empty((p.shape[0], 8), np.uint8)
    scales[:, :4] = p[:, 0:4] & 63
    mins[:, :4] = p[:, 4:8] & 63
    scales[:, 4:] = (p[:, 8:12] & 0x0F) | ((p[:, 0:4] >> 6) << 4)
    mins[:, 4:] = (p[:, 8:12] >> 4) | ((p[:, 4:8] >> 6) << 4)
    return scales.astype(np.float32), mins.astype(np.float32)


def dequantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    """Super-block: f16 d, f16 dmin, 12 bytes of scales/mins, 128 bytes of 4-bit q.
    Sub-block j (32 values) = d * scale_j * q - dmin * min_j; each 32-byte chunk of q holds
    sub-block 2i in its low nibbles and 2i+1 in its high nibbles."""
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    scales, mins = _k4_scales_and_mins(blocks[:, 4:16])
    qs = blocks[:, 16:144].reshape(-1, 4, 32)  # [n, chunk, byte]
    q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32).astype(np.float32)  # [n, sub-block, 32]
    return (d[:, :, None] * scales[:, :, None] * q - dmin[:, :, None] * mins[:, :, None]).reshape(-1, QK_K)


def dequantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    """Super-block: 128 bytes low 4 bits (ql), 64 bytes high 2 bits (qh), 16 int8 scales, f16 d.
    Each half (128 values) takes 64 bytes of ql and 32 of qh; q is 6-bit, offset by 32, and each
    16 values share one scale."""
    ql = blocks[:, 0:128].reshape(-1, 2, 64)  # [n, half, byte]
    qh = blocks[:, 128:192].reshape(-1, 2, 32)
    scales = blocks[:, 192:208].view(np.int8).astype(np.float32).reshape(-1, 2, 8)
    d = _f16(blocks[:, 208:210])
    low = np.concatenate(
        [ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=-1
    )
    high = np.concatenate([(qh >> shift) & 3 for shift in (0, 2, 4, 6)], axis=-1)
    q = (low.astype(np.int16) | (high.astype(np.int16) << 4)) - 32  # [n, half, 128]
    per_value_scale = np.repeat(scales, 16, axis=-1)  # [n, half, 128]
    return (d[:, :, None] * per_value_scale * q).reshape(-1, QK_K)


_DECODERS = {
    GGMLQuantizationType.Q8_0: dequantize_q8_0,
    GGMLQuantizationType.Q4_K: dequantize_q4_k,
    GGMLQuantizationType.Q6_K: dequantize_q6_k,
}


def dequantize(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """float32 values of a GGUF tensor's data (as `GGUFReader` exposes it) in numpy order."""
    if qtype == GGMLQuantizationType.F32:
        return np.asarray(data, dtype=np.float32)
    if qtype == GGMLQuantizationType.F16:
        return np.asarray(data).view(np.float16).astype(np.float32)
    if qtype == GGMLQuantizationType.BF16:
        bits = np.ascontiguousarray(data).view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32)
    decoder = _DECODERS.get(qtype)
    if decoder is None:
        return gguf_quants.dequantize(np.asarray(data), qtype).astype(np.float32)
    blocks, shape = _blocks(data, qtype)
    return decoder(blocks).reshape(shape)


# -- the same decoders in MLX ops (GPU on Apple silicon); the numpy ones above are the reference --
def _mx_f16(raw: mx.array) -> mx.array:
    return mx.view(raw, mx.float16).astype(mx.float32)  # [n, 2] uint8 -> [n, 1]


def _mx_q8_0(blocks: mx.array) -> mx.array:
    return _mx_f16(blocks[:, :2]) * mx.view(blocks[:, 2:], mx.int8).astype(mx.float32)


def _mx_k4_scales_and_mins(p: mx.array) -> tuple[mx.array, mx.array]:
    low_scales, low_mins, high = p[:, 0:4], p[:, 4:8], p[:, 8:12]
    scales = mx.concatenate([low_scales & 63, (high & 0x0F) | ((low_scales >> 6) << 4)], axis=1)
    mins = mx.concatenate([low_mins & 63, (high >> 4) | ((low_mins >> 6) << 4)], axis=1)
    return scales.astype(mx.float32), mins.astype(mx.float32)


def _mx_q4_k(blocks: mx.array) -> mx.array:
    d, dmin = _mx_f16(blocks[:, 0:2]), _mx_f16(blocks[:, 2:4])
    scales, mins = _mx_k4_scales_and_mins(blocks[:, 4:16])
    qs = blocks[:, 16:144].reshape(-1, 4, 32)  # [n, chunk, byte]
    q = mx.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32).astype(mx.float32)  # [n, sub-block, 32]
    values = (d * scales)[:, :, None] * q - (dmin * mins)[:, :, None]
    return values.reshape(-1, QK_K)


def _mx_q6_k(blocks: mx.array) -> mx.array:
    ql = blocks[:, 0:128].reshape(-1, 2, 64)  # [n, half, byte]
    qh = blocks[:, 128:192].reshape(-1, 2, 32)
    scales = mx.view(blocks[:, 192:208], mx.int8).astype(mx.float32).reshape(-1, 2, 8)
    d = _mx_f16(blocks[:, 208:210])
    low = mx.concatenate(
        [ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=-1
    )
    high = mx.concatenate([(qh >> shift) & 3 for shift in (0, 2, 4, 6)], axis=-1)
    q = (low.astype(mx.int16) | (high.astype(mx.int16) << 4)) - 32  # [n, half, 128]
    per_value_scale = mx.repeat(scales, 16, axis=-1)
    return (d[:, :, None] * per_value_scale * q.astype(mx.float32)).reshape(-1, QK_K)


_MX_DECODERS = {
    GGMLQuantizationType.Q8_0: _mx_q8_0,
    GGMLQuantizationType.Q4_K: _mx_q4_k,
    GGMLQuantizationType.Q6_K: _mx_q6_k,
}


def dequantize_mx(data: np.ndarray, qtype: GGMLQuantizationType) -> mx.array:
    """Like `dequantize`, computed with MLX (fast on the GPU); other types use the numpy path."""
    decoder = _MX_DECODERS.get(qtype)
    if decoder is None:
        return mx.array(dequantize(data, qtype))
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    raw = np.ascontiguousarray(data).view(np.uint8)
    shape = (*raw.shape[:-1], raw.shape[-1] // type_size * block_size)
    return decoder(mx.array(raw.reshape(-1, type_size))).reshape(shape)
