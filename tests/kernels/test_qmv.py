"""The quantized mat-vec kernel against its reference.

On CPU the CUDA source can't run, so a NumPy transcription of its unpacking (bit stream per
32-value chunk, e2m1 / e8m0 / e4m3 decoding) is checked against `mx.dequantize`: that pins the
layout the kernel assumes. The kernel itself is compared on a CUDA GPU (marker `gpu`).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kapitsa.engine.kernels import backend
from kapitsa.engine.kernels.qmv import qmv, qmv_reference, qmv_v1

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


def _e4m3(v: np.ndarray) -> np.ndarray:
    s, e, m = (v >> 7) & 1, (v >> 3) & 15, v & 7
    f = np.where(e == 0, np.ldexp(m.astype(np.float32), -9), np.ldexp(1 + m / 8.0, e.astype(np.int32) - 7))
    return np.where(s == 1, -f, f).astype(np.float32)


def _kernel_dequant(
    w: np.ndarray, scales: np.ndarray, biases, *, k: int, gs: int, bits: int, mode: str
) -> np.ndarray:
    n = w.shape[0]
    out = np.zeros((n, k), np.float32)
    for c in range(k // 32):
        words = w[:, c * bits : (c + 1) * bits].astype(np.uint64)
        for j in range(32):
            off = j * bits
            wi, sh = off >> 5, off & 31
            q = words[:, wi] >> np.uint64(sh)
            if sh + bits > 32:
                q |= words[:, wi + 1] << np.uint64(32 - sh)
            q = (q & np.uint64((1 << bits) - 1)).astype(np.int64)
            g = (c * 32 + j) // gs
            if mode == "affine":
                out[:, c * 32 + j] = scales[:, g] * q + biases[:, g]
            elif mode == "mxfp4":
                out[:, c * 32 + j] = np.ldexp(1.0, scales[:, g].astype(np.int32) - 127) * E2M1[q]
            else:
                out[:, c * 32 + j] = _e4m3(scales[:, g].astype(np.int64)) * E2M1[q]
    return out


CASES = [("affine", b, 64) for b in (2, 3, 4, 6, 8)] + [
    ("affine", 4, 32),
    ("affine", 8, 128),
    ("mxfp4", 4, 32),
    ("nvfp4", 4, 16),
]


@pytest.mark.parametrize("mode,bits,gs", CASES)
def test_kernel_unpacking_matches_mlx_dequantize(mode: str, bits: int, gs: int) -> None:
    mx.random.seed(0)
    n, k = 6, 128
    weights = mx.random.normal((n, k))
    if mode == "affine":
        w, scales, biases = mx.quantize(weights, group_size=gs, bits=bits)
    else:
        (w, scales), biases = mx.quantize(weights, group_size=gs, bits=bits, mode=mode), None
    ref = mx.dequantize(w, scales, biases, group_size=gs, bits=bits, mode=mode)
    got = _kernel_dequant(
        np.array(w),
        np.array(scales),
        None if biases is None else np.array(biases),
        k=k,
        gs=gs,
        bits=bits,
        mode=mode,
    )
    np.testing.assert_allclose(got, np.array(ref.astype(mx.float32)), rtol=1e-2, atol=1e-6)


def test_qmv_falls_back_to_reference_off_gpu() -> None:
    mx.random.seed(1)
    x = mx.random.normal((3, 128))
    w, s, b = mx.quantize(mx.random.normal((8, 128)), group_size=64, bits=4)
    if backend() is None:
        assert mx.array_equal(
            qmv(x, w, s, b, group_size=64, bits=4), qmv_reference(x, w, s, b, group_size=64, bits=4)
        )


@pytest.mark.gpu
@pytest.mark.parametrize("mode,bits,gs", CASES)
@pytest.mark.parametrize("rows", [1, 4, 16])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_cuda_qmv_v1_matches_reference(mode: str, bits: int, gs: int, rows: int, dtype) -> None:
    """The first kernel, called directly (qmv itself routes affine 4/8-bit to v2)."""
    if backend() != "cuda":
        pytest.skip("needs the CUDA backend")
    mx.random.seed(2)
    n, k = 512, 1024
    weights = mx.random.normal((n, k)).astype(dtype)
    if mode == "affine":
        w, s, b = mx.quantize(weights, group_size=gs, bits=bits)
    else:
        (w, s), b = mx.quantize(weights, group_size=gs, bits=bits, mode=mode), None
    x = mx.random.normal((rows, k)).astype(dtype)
    got = qmv_v1(x, w, s, b, group_size=gs, bits=bits, mode=mode).astype(mx.float32)
    ref = qmv_reference(x, w, s, b, group_size=gs, bits=bits, mode=mode).astype(mx.float32)
    assert mx.allclose(got, ref, rtol=2e-2, atol=2e-1).item(), float(mx.abs(got - ref).max())
