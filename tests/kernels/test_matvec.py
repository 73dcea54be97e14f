"""The general quantized mat-vec kernel (kapitsa/engine/kernels/matvec.py) against its reference.

No GPU here, so the CPU tests run a NumPy transcription of the kernel: its own index math (blocks,
warps, R rows per warp, rounds of 32 chunks, x staged tile by tile in a buffer of exactly the
shared-memory size it requests, NaN where nothing was staged) and its weight decoding with the
constants parsed out of the CUDA header. That pins the packing layout against `mx.quantize`, the
launch configuration and the tiling. nvcc compiles the variants; the `gpu` tests compare the real
kernel with the reference on the 27B's shapes.
"""

from __future__ import annotations

import math
import re
import sys
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np
import pytest

from kapitsa.engine.kernels import backend, matvec

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from nvcc_check import compile_source, nvcc  # noqa: E402

# ---- NumPy transcription of the kernel ----

MAGIC = 0x4B000000


def _fields_4bit() -> list[list[tuple[str, int, float, float]]]:
    """[(source word, mask, factor, offset)] for values 0-3 and 4-7 of a word, from the header."""
    body = matvec._KERNEL.header.split("kq2_nibbles", 1)[1].split("kq2_bytes", 1)[0]
    low, high = body.split("const uint32_t hi = w >> 12;")
    pattern = re.compile(r"kq2_field\((w|hi), (0x[0-9A-F]+)u, ([0-9.e-]+)f, (-?[0-9.]+)f\)")
    halves = [
        [(src, int(mask, 16), float(f), float(o)) for src, mask, f, o in pattern.findall(part)]
        for part in (low, high)
    ]
    assert [len(h) for h in halves] == [4, 4], halves
    return halves


def _selectors_8bit() -> list[int]:
    body = matvec._KERNEL.header.split("kq2_bytes", 1)[1]
    selectors = [int(s, 16) for s in re.findall(r"__byte_perm\(w, 0x4B000000u, (0x[0-9a-f]+)u\)", body)]
    assert len(selectors) == 4, selectors
    return selectors


def byte_perm(a: np.ndarray, b: int, selector: int) -> np.ndarray:
    """CUDA __byte_perm: result byte i is byte (selector >> 4i) & 7 of the 8 bytes b:a."""
    out = np.zeros_like(a)
    for i in range(4):
        pick = (selector >> (4 * i)) & 7
        source = a if pick < 4 else np.full_like(a, b)
        out |= ((source >> np.uint32(8 * (pick % 4))) & np.uint32(0xFF)) << np.uint32(8 * i)
    return out


def _as_float(bits: np.ndarray) -> np.ndarray:
    return bits.astype(np.uint32).view(np.float32)


def decode_word(words: np.ndarray, bits: int) -> np.ndarray:
    """[..., 32 // bits] float32 values of uint32 words, decoded as the kernel does."""
    words = words.astype(np.uint32)
    if bits == 8:
        return np.stack(
            [_as_float(byte_perm(words, MAGIC, s)) - np.float32(8388608.0) for s in _selectors_8bit()], -1
        )
    sources = {"w": words, "hi": words >> np.uint32(12)}
    values = []
    for half in _fields_4bit():
        for src, mask, factor, offset in half:
            f = _as_float((sources[src] & np.uint32(mask)) | np.uint32(MAGIC))
            values.append(f * np.float32(factor) + np.float32(offset))  # both steps exact in float32
    return np.stack(values, -1)


def emulate(
    x: np.ndarray, w: np.ndarray, scales: np.ndarray, biases: np.ndarray, template: list, shared: int
) -> np.ndarray:
    """y [M, N] as the kernel computes it for `template` (from matvec.launch_config)."""
    t = dict(template)
    m_rows, n, k, gs, bits, r_rows, warps, tile_rounds = (
        t[key] for key in ("M", "N", "K", "GS", "BITS", "R", "WARPS", "TILE_ROUNDS")
    )
    ch = 128 // bits
    nch, stride = k // ch, ch + 4
    rounds = math.ceil(nch / 32)
    tch = min(tile_rounds * 32, nch)
    smem = np.full(shared // 4, np.nan, np.float32)  # unstaged slots poison the result
    xsum_base = m_rows * tch * stride
    blocks = math.ceil(n / (r_rows * warps))
    row_ids = np.arange(blocks * warps * r_rows)  # (block * WARPS + warp) * R + r
    rows = np.minimum(row_ids, n - 1)
    chunks = w.reshape(n, nch, 4)  # one 16-byte chunk = 4 words
    acc = np.zeros((len(rows), m_rows), np.float32)
    xf = x.astype(np.float32)
    for j in range(rounds):
        c0 = (j // tile_rounds) * tch
        if j % tile_rounds == 0:
            smem[:] = np.nan
            tile_chunks = min(tch, nch - c0)
            for i in range(m_rows * tile_chunks):
                m, cl = divmod(i, tile_chunks)
                values = xf[m, (c0 + cl) * ch : (c0 + cl + 1) * ch]
                dst = (m * tch + cl) * stride
                smem[dst : dst + ch] = values
                smem[xsum_base + m * tch + cl] = values.sum(dtype=np.float32)
        for lane in range(32):
            c = j * 32 + lane
            if c >= nch:
                continue
            cl = c - c0
            q = decode_word(chunks[rows, c], bits).reshape(len(rows), ch)
            s = scales[rows, c * ch // gs].astype(np.float32)
            b = biases[rows, c * ch // gs].astype(np.float32)
            for m in range(m_rows):
                base = (m * tch + cl) * stride
                xs = smem[base : base + ch]
                dot = (q * xs).sum(-1, dtype=np.float32)
                acc[:, m] += s * dot + b * smem[xsum_base + m * tch + cl]
    return acc[:n].T  # rows past N are computed but never stored


def _quantized(n: int, k: int, *, bits: int, gs: int, dtype=mx.float32, seed: int = 0):
    mx.random.seed(seed)
    w, s, b = mx.quantize(mx.random.normal((n, k)).astype(dtype), group_size=gs, bits=bits)
    return w, s, b


def _np(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32))


def _precise_reference(x, w, s, b, *, gs: int, bits: int) -> np.ndarray:
    """float32 all the way (mx.dequantize would round the weights to the scales' dtype)."""
    f32 = mx.float32
    weights = mx.dequantize(w, s.astype(f32), b.astype(f32), group_size=gs, bits=bits)
    return np.array(x.astype(f32) @ weights.T)


# ---- CPU: layout, constants, tiling ----


@pytest.mark.parametrize("bits", [4, 8])
def test_word_decoding_matches_mlx_packing(bits: int) -> None:
    """Every value of every word decodes to the integer mx.quantize packed there."""
    k = 256
    w, s, b = _quantized(4, k, bits=bits, gs=32)
    q = np.array(w)
    decoded = decode_word(q, bits).reshape(4, k)
    dequant = np.array(mx.dequantize(w, s, b, group_size=32, bits=bits))
    rebuilt = decoded * np.repeat(np.array(s), 32, 1) + np.repeat(np.array(b), 32, 1)
    np.testing.assert_allclose(rebuilt, dequant, rtol=1e-6, atol=1e-6)
    assert decoded.min() == 0 and decoded.max() == 2**bits - 1
    assert np.array_equal(decoded, np.round(decoded))


def test_byte_perm_emulation() -> None:
    a = np.array([0x44332211], np.uint32)
    assert byte_perm(a, 0x88776655, 0x3210)[0] == 0x44332211
    assert byte_perm(a, 0x88776655, 0x7654)[0] == 0x88776655
    assert byte_perm(a, 0x4B000000, 0x7442)[0] == 0x4B000033


CPU_CASES = [
    # rows, n, k, bits, gs: odd N (a part-filled last warp), K not a multiple of 32 chunks, tiles
    (1, 37, 512, 4, 32),
    (1, 16, 1024, 8, 128),
    (2, 24, 1536, 4, 64),
    (3, 40, 640, 8, 64),
    (4, 16, 2048, 4, 128),
    (5, 19, 1024, 4, 64),
    (8, 16, 3072, 4, 32),
    (8, 9, 1024, 8, 32),
]


@pytest.mark.parametrize("rows,n,k,bits,gs", CPU_CASES)
def test_emulated_kernel_matches_reference(rows: int, n: int, k: int, bits: int, gs: int) -> None:
    w, s, b = _quantized(n, k, bits=bits, gs=gs, dtype=mx.bfloat16, seed=rows)
    mx.random.seed(7)
    x = mx.random.normal((rows, k)).astype(mx.bfloat16)
    template, shared, grid, block = matvec.launch_config(x, n, group_size=gs, bits=bits)
    t = dict(template)
    assert grid % block == 0 and grid // block * t["WARPS"] * t["R"] >= n and block == 32 * t["WARPS"]
    got = emulate(np.array(x.astype(mx.float32)), np.array(w), _np(s), _np(b), template, shared)
    ref = _precise_reference(x, w, s, b, gs=gs, bits=bits)
    assert np.isfinite(got).all()  # every staged value read was staged
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-3 * np.abs(ref).max())


def test_small_shared_budget_forces_several_tiles(monkeypatch) -> None:
    """The tiled path (several tiles, a part-filled last one) agrees with the one-tile path."""
    monkeypatch.setattr(matvec, "SHARED_BUDGET", 2 * 32 * 37 * 4)  # two rounds per tile
    w, s, b = _quantized(8, 5 * 1024, bits=4, gs=64)
    x = mx.random.normal((2, 5 * 1024))
    template, shared, _, _ = matvec.launch_config(x, 8, group_size=64, bits=4)
    assert dict(template)["TILE_ROUNDS"] == 1 and shared == 2 * 32 * 37 * 4
    got = emulate(np.array(x), np.array(w), np.array(s), np.array(b), template, shared)
    np.testing.assert_allclose(got, _precise_reference(x, w, s, b, gs=64, bits=4), rtol=1e-4, atol=1e-2)


@pytest.mark.parametrize("rows", range(1, 9))
@pytest.mark.parametrize("bits", [4, 8])
def test_shared_memory_fits_without_opt_in(rows: int, bits: int) -> None:
    for k in (2560, 5120, 6144, 17408, 32768):
        assert matvec.shared_bytes(rows, k, bits) <= 48 * 1024


def test_supports_general_rules(monkeypatch) -> None:
    w, s, b = _quantized(8, 256, bits=4, gs=64)
    x = mx.zeros((1, 256), mx.bfloat16)
    assert not matvec.supports_general(x, w, s, b, group_size=64, bits=4)  # no CUDA here
    monkeypatch.setattr(matvec, "backend", lambda: "cuda")
    assert matvec.supports_general(x, w, s, b, group_size=64, bits=4)
    assert matvec.supports_general(mx.zeros((8, 256)), w, s, b, group_size=64, bits=4)
    assert not matvec.supports_general(mx.zeros((9, 256)), w, s, b, group_size=64, bits=4)
    assert not matvec.supports_general(x, w, s, None, group_size=64, bits=4)
    assert not matvec.supports_general(x, w, s, b, group_size=32, bits=4)  # scales say 64
    assert not matvec.supports_general(mx.zeros((1, 128)), w, s, b, group_size=64, bits=4)
    assert not matvec.supports_general(x.astype(mx.int32), w, s, b, group_size=64, bits=4)
    w3, s3, b3 = _quantized(8, 256, bits=3, gs=64)
    assert not matvec.supports_general(x, w3, s3, b3, group_size=64, bits=3)


# ---- nvcc: every launched variant compiles for sm_90 ----


def _render(rows: int, bits: int, dtype) -> str:
    x = mx.zeros((rows, 5120), dtype)
    template, _, _, _ = matvec.launch_config(x, 17408, group_size=64, bits=bits)
    return matvec._KERNEL.render([dtype, mx.uint32, dtype, dtype], [dtype], template)


def _compile_all(variants) -> None:
    with ThreadPoolExecutor(2) as pool:
        for variant, (ok, log) in zip(
            variants, pool.map(lambda v: compile_source(_render(*v)), variants), strict=True
        ):
            assert ok, (variant, log[-3000:])
            assert "warning" not in log.lower(), (variant, log[-3000:])


needs_nvcc = pytest.mark.skipif(nvcc() is None, reason="nvcc not installed")


@needs_nvcc
def test_representative_variants_compile() -> None:
    _compile_all([(1, 4, mx.bfloat16), (3, 8, mx.float16), (8, 4, mx.float32), (5, 8, mx.bfloat16)])


@needs_nvcc
@pytest.mark.slow
def test_every_launched_variant_compiles() -> None:
    """The code differs by rows (R, WARPS, M), bits and dtype; N, K, GS only change constants."""
    dtypes = (mx.bfloat16, mx.float16, mx.float32)
    _compile_all([(rows, bits, d) for rows in range(1, 9) for bits in (4, 8) for d in dtypes])


def test_header_constants_are_what_the_decoder_read() -> None:
    """The parsing above found every constant (a refactor of the header must update it)."""
    assert len(re.findall(r"kq2_field\(", matvec._KERNEL.header)) == 8 + 1  # 8 uses + the definition
    assert math.isclose(_fields_4bit()[1][0][2], 2**-16)


# ---- GPU: the real kernel on the 27B's shapes ----

GPU_SHAPES = [(17408, 5120), (5120, 17408), (8192, 5120), (6144, 2560)]
GPU_CASES = (
    [(n, k, rows, bits, 64, mx.bfloat16) for n, k in GPU_SHAPES for rows in range(1, 9) for bits in (4, 8)]
    + [
        (n, k, rows, bits, gs, mx.bfloat16)
        for n, k in GPU_SHAPES[:2]
        for rows in (1, 3, 8)
        for bits in (4, 8)
        for gs in (32, 128)
    ]
    + [(n, k, rows, bits, 64, mx.float16) for n, k in GPU_SHAPES for rows in (1, 4, 8) for bits in (4, 8)]
    + [(n, k, rows, 4, 64, mx.float32) for n, k in GPU_SHAPES[2:] for rows in (1, 5)]
)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,rows,bits,gs,dtype", GPU_CASES)
def test_cuda_general_kernel_matches_reference(n: int, k: int, rows: int, bits: int, gs: int, dtype) -> None:
    if backend() != "cuda":
        pytest.skip("needs the CUDA backend")
    w, s, b = _quantized(n, k, bits=bits, gs=gs, dtype=dtype, seed=n + k)
    x = mx.random.normal((rows, k)).astype(dtype)
    assert matvec.supports_general(x, w, s, b, group_size=gs, bits=bits)
    got = np.array(matvec.qmv_general(x, w, s, b, group_size=gs, bits=bits).astype(mx.float32))
    ref = _precise_reference(x, w, s, b, gs=gs, bits=bits)
    # The kernel rounds its float32 sums once to x's dtype; a layout error is off by O(1).
    rtol = {mx.bfloat16: 2**-7, mx.float16: 2**-10, mx.float32: 1e-5}[dtype]
    np.testing.assert_allclose(got, ref, rtol=rtol, atol=1e-3 * np.abs(ref).max())


@pytest.mark.gpu
def test_cuda_general_kernel_on_a_row_slice() -> None:
    """Row-sliced inputs (non-zero offsets) agree with the reference."""
    if backend() != "cuda":
        pytest.skip("needs the CUDA backend")
    w, s, b = _quantized(1024 + 13, 2048, bits=4, gs=64, dtype=mx.bfloat16)
    w, s, b = w[13:], s[13:], b[13:]
    x = mx.random.normal((6, 2048)).astype(mx.bfloat16)[2:5]
    ref = _precise_reference(x, w, s, b, gs=64, bits=4)
    got = matvec.qmv_general(x, w, s, b, group_size=64, bits=4)
    np.testing.assert_allclose(_np(got), ref, rtol=2**-6, atol=2e-3 * np.abs(ref).max())
