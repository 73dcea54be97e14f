"""The Metal port of the general mat-vec (metal/matvec_general.metal): checked here for consistency
with the CUDA kernel (constants, template values, threadgroup memory, the tiling its budget gives,
run through the NumPy transcription of test_matvec.py), and run against the reference only where
Metal is (marker `metal`)."""

from __future__ import annotations

import re

import mlx.core as mx
import numpy as np
import pytest

from kapitsa.engine.kernels import backend, matvec
from kapitsa.engine.kernels.metal import read_source
from tests.kernels.test_matvec import _precise_reference, _quantized, emulate

FIELD = re.compile(r"kq2_field\((w|hi), (0x[0-9A-F]+)u, ([0-9.e-]+)f, (-?[0-9.]+)f\)")


def test_metal_port_uses_the_cuda_constants_and_every_template_value() -> None:
    header, body = read_source("matvec_general.metal")
    assert FIELD.findall(header) == FIELD.findall(matvec._KERNEL.header)
    x = mx.zeros((3, 5120), mx.bfloat16)
    template, grid, block = matvec.metal_launch_config(x, 6144, group_size=64, bits=4)
    for name, _ in template:
        assert re.search(rf"\b{name}\b", body), name
    assert "thread_index_in_simdgroup" in body and "simd_sum" in body


@pytest.mark.parametrize("rows", range(1, 9))
@pytest.mark.parametrize("bits", [4, 8])
def test_metal_threadgroup_memory_fits(rows: int, bits: int, monkeypatch) -> None:
    """Where the port is used, its staged x fits 32 KiB; 4-bit with 7+ rows is left to stock."""
    monkeypatch.setattr(matvec, "backend", lambda: "metal")
    w, s, b = _quantized(64, 2560, bits=bits, gs=64)
    assert matvec.supports_general(mx.zeros((rows, 2560)), w, s, b, group_size=64, bits=bits) == (
        bits == 8 or rows <= 6
    )
    if bits == 4 and rows > 6:
        return
    for k in (2560, 5120, 17408):
        template, _, _ = matvec.metal_launch_config(mx.zeros((rows, k)), 64, group_size=64, bits=bits)
        smem = dict(template)["SMEM_FLOATS"]
        assert smem * 4 <= 32 * 1024 and smem % 4 == 0
        assert smem * 4 >= matvec.shared_bytes(rows, k, bits, matvec.METAL_SHARED_BUDGET)


def test_metal_layout_emulates_correctly() -> None:
    """The Metal budget's tiling (more, smaller tiles) gives the same result in the transcription."""
    w, s, b = _quantized(16, 17408 // 4, bits=4, gs=64)
    x = mx.random.normal((4, 17408 // 4))
    template, shared, _, _ = matvec.launch_config(
        x, 16, group_size=64, bits=4, budget=matvec.METAL_SHARED_BUDGET
    )
    got = emulate(np.array(x), np.array(w), np.array(s), np.array(b), template, shared)
    np.testing.assert_allclose(got, _precise_reference(x, w, s, b, gs=64, bits=4), rtol=1e-4, atol=1e-2)


@pytest.mark.metal
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
def test_metal_general_kernel_matches_reference(rows: int, bits: int, dtype) -> None:
    if backend() != "metal":
        pytest.skip("needs Metal")
    for n, k in ((2560, 2560), (1024 + 3, 9728)):
        w, s, b = _quantized(n, k, bits=bits, gs=64, dtype=dtype)
        x = mx.random.normal((rows, k)).astype(dtype)
        got = np.array(matvec.qmv_general(x, w, s, b, group_size=64, bits=bits).astype(mx.float32))
        ref = _precise_reference(x, w, s, b, gs=64, bits=bits)
        rtol = {mx.bfloat16: 2**-7, mx.float16: 2**-10, mx.float32: 1e-5}[dtype]
        np.testing.assert_allclose(got, ref, rtol=rtol, atol=1e-3 * np.abs(ref).max())
