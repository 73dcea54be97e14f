"""The v2 quantized mat-vec kernel (kapitsa/engine/kernels/qmv_fast.py) against its reference.

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

from kapitsa.engine.kernels import backend, qmv_fast, qmv_mma
from kapitsa.engine.kernels import qmv as qmv_mod
from kapitsa.engine.kernels.metal import read_source
from kapitsa.engine.kernels.qmv import qmv, qmv_reference

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from nvcc_check import compile_source, nvcc  # noqa: E402

# ---- NumPy transcription of the kernel ----

MAGIC = 0x4B000000


def _fields_4bit() -> list[list[tuple[str, int, float, float]]]:
    """[(source word, mask, factor, offset)] for values 0-3 and 4-7 of a word, from the header."""
    body = qmv_fast._KERNEL.header.split("kq2_nibbles", 1)[1].split("kq2_bytes", 1)[0]
    low, high = body.split("const uint32_t hi = w >> 12;")
    pattern = re.compile(r"kq2_field\((w|hi), (0x[0-9A-F]+)u, ([0-9.e-]+)f, (-?[0-9.]+)f\)")
    halves = [
        [(src, int(mask, 16), float(f), float(o)) for src, mask, f, o in pattern.findall(part)]
        for part in (low, high)
    ]
    assert [len(h) for h in halves] == [4, 4], halves
    return halves


def _selectors_8bit() -> list[int]:
    body = qmv_fast._KERNEL.header.split("kq2_bytes", 1)[1]
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
    """y [M, N] as the kernel computes it for `template` (from qmv_fast.launch_config)."""
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
    template, shared, grid, block = qmv_fast.launch_config(x, n, group_size=gs, bits=bits)
    t = dict(template)
    assert grid % block == 0 and grid // block * t["WARPS"] * t["R"] >= n and block == 32 * t["WARPS"]
    got = emulate(np.array(x.astype(mx.float32)), np.array(w), _np(s), _np(b), template, shared)
    ref = _precise_reference(x, w, s, b, gs=gs, bits=bits)
    assert np.isfinite(got).all()  # every staged value read was staged
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-3 * np.abs(ref).max())


def test_small_shared_budget_forces_several_tiles(monkeypatch) -> None:
    """The tiled path (several tiles, a part-filled last one) agrees with the one-tile path."""
    monkeypatch.setattr(qmv_fast, "SHARED_BUDGET", 2 * 32 * 37 * 4)  # two rounds per tile
    w, s, b = _quantized(8, 5 * 1024, bits=4, gs=64)
    x = mx.random.normal((2, 5 * 1024))
    template, shared, _, _ = qmv_fast.launch_config(x, 8, group_size=64, bits=4)
    assert dict(template)["TILE_ROUNDS"] == 1 and shared == 2 * 32 * 37 * 4
    got = emulate(np.array(x), np.array(w), np.array(s), np.array(b), template, shared)
    np.testing.assert_allclose(got, _precise_reference(x, w, s, b, gs=64, bits=4), rtol=1e-4, atol=1e-2)


@pytest.mark.parametrize("rows", range(1, 9))
@pytest.mark.parametrize("bits", [4, 8])
def test_shared_memory_fits_without_opt_in(rows: int, bits: int) -> None:
    for k in (2560, 5120, 6144, 17408, 32768):
        assert qmv_fast.shared_bytes(rows, k, bits) <= 48 * 1024


def test_supports_fast_rules(monkeypatch) -> None:
    w, s, b = _quantized(8, 256, bits=4, gs=64)
    x = mx.zeros((1, 256), mx.bfloat16)
    assert not qmv_fast.supports_fast(x, w, s, b, group_size=64, bits=4)  # no CUDA here
    monkeypatch.setattr(qmv_fast, "backend", lambda: "cuda")
    assert qmv_fast.supports_fast(x, w, s, b, group_size=64, bits=4)
    assert qmv_fast.supports_fast(mx.zeros((8, 256)), w, s, b, group_size=64, bits=4)
    assert not qmv_fast.supports_fast(mx.zeros((9, 256)), w, s, b, group_size=64, bits=4)
    assert not qmv_fast.supports_fast(x, w, s, None, group_size=64, bits=4)
    assert not qmv_fast.supports_fast(x, w, s, b, group_size=32, bits=4)  # scales say 64
    assert not qmv_fast.supports_fast(mx.zeros((1, 128)), w, s, b, group_size=64, bits=4)
    assert not qmv_fast.supports_fast(x.astype(mx.int32), w, s, b, group_size=64, bits=4)
    w3, s3, b3 = _quantized(8, 256, bits=3, gs=64)
    assert not qmv_fast.supports_fast(x, w3, s3, b3, group_size=64, bits=3)


def test_qmv_routes_by_the_measured_table(monkeypatch) -> None:
    w, s, b = _quantized(8, 256, bits=4, gs=64)
    calls = []
    for module in (qmv_fast, qmv_mma, qmv_mod):
        monkeypatch.setattr(module, "backend", lambda: "cuda")
    monkeypatch.setattr(qmv_mod, "qmv_fast", lambda *a, **kw: calls.append("v2"))
    monkeypatch.setattr(qmv_mod, "qmv_v1", lambda *a, **kw: calls.append("v1"))
    monkeypatch.setattr(qmv_mod, "qmv_mma", lambda *a, **kw: calls.append("v2mma"))
    for rows in (1, 8, 9):
        qmv(mx.zeros((rows, 256)), w, s, b, group_size=64, bits=4)
    monkeypatch.setitem(qmv_mod.CUDA_ROUTES, ("affine", 4), {2: "v1", 3: "v2mma"})
    qmv(mx.zeros((1, 256)), w, s, b, group_size=64, bits=4)
    qmv(mx.zeros((3, 256), mx.bfloat16), w, s, b, group_size=64, bits=4)
    qmv(mx.zeros((3, 256)), w, s, b, group_size=64, bits=4)  # float32 x: no tensor-core variant
    # 9 rows: v2 can't, v1 can; a row the table leaves out: v1 (qmv runs a kernel where it can)
    assert calls == ["v2", "v2", "v1", "v1", "v2mma", "v2"]
    assert qmv_mod.prefer_kernel(2, bits=4, mode="affine")
    assert not qmv_mod.prefer_kernel(1, bits=4, mode="affine")


def test_default_table_prefers_v2_for_affine_4_and_8_bit() -> None:
    for bits in (4, 8):
        assert [qmv_mod.route(r, bits=bits, mode="affine") for r in range(1, 10)] == ["v2"] * 8 + ["stock"]
    assert qmv_mod.route(1, bits=4, mode="mxfp4") == "stock"
    assert qmv_mod.route(1, bits=6, mode="affine") == "stock"


def test_qmv_falls_back_to_reference_off_gpu() -> None:
    if backend() is not None:
        pytest.skip("runs where there is no GPU backend")
    w, s, b = _quantized(8, 256, bits=8, gs=64)
    x = mx.random.normal((2, 256))
    assert mx.array_equal(
        qmv(x, w, s, b, group_size=64, bits=8), qmv_reference(x, w, s, b, group_size=64, bits=8)
    )


# ---- nvcc: every launched variant compiles for sm_90 ----


def _render(rows: int, bits: int, dtype, mma: bool = False) -> str:
    x = mx.zeros((rows, 5120), dtype)
    if mma:
        template, _, _ = qmv_mma.mma_launch_config(x, 17408, group_size=64, bits=bits)
        return qmv_mma._MMA_KERNEL.render([dtype, mx.uint32, dtype, dtype], [dtype], template)
    template, _, _, _ = qmv_fast.launch_config(x, 17408, group_size=64, bits=bits)
    return qmv_fast._KERNEL.render([dtype, mx.uint32, dtype, dtype], [dtype], template)


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
    _compile_all([(2, 4, mx.bfloat16, True), (8, 8, mx.float16, True)])


@needs_nvcc
@pytest.mark.slow
def test_every_launched_variant_compiles() -> None:
    """The code differs by rows (R, WARPS, M), bits and dtype; N, K, GS only change constants."""
    dtypes = (mx.bfloat16, mx.float16, mx.float32)
    _compile_all([(rows, bits, d) for rows in range(1, 9) for bits in (4, 8) for d in dtypes])
    _compile_all([(rows, bits, d, True) for rows in range(1, 9) for bits in (4, 8) for d in dtypes[:2]])


def test_header_constants_are_what_the_decoder_read() -> None:
    """The parsing above found every constant (a refactor of the header must update it)."""
    assert len(re.findall(r"kq2_field\(", qmv_fast._KERNEL.header)) == 8 + 1  # 8 uses + the definition
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
def test_cuda_qmv_fast_matches_reference(n: int, k: int, rows: int, bits: int, gs: int, dtype) -> None:
    if backend() != "cuda":
        pytest.skip("needs the CUDA backend")
    w, s, b = _quantized(n, k, bits=bits, gs=gs, dtype=dtype, seed=n + k)
    x = mx.random.normal((rows, k)).astype(dtype)
    assert qmv_fast.supports_fast(x, w, s, b, group_size=gs, bits=bits)
    got = np.array(qmv_fast.qmv_fast(x, w, s, b, group_size=gs, bits=bits).astype(mx.float32))
    ref = _precise_reference(x, w, s, b, gs=gs, bits=bits)
    # The kernel rounds its float32 sums once to x's dtype; a layout error is off by O(1).
    rtol = {mx.bfloat16: 2**-7, mx.float16: 2**-10, mx.float32: 1e-5}[dtype]
    np.testing.assert_allclose(got, ref, rtol=rtol, atol=1e-3 * np.abs(ref).max())


MMA_GPU_CASES = [
    (n, k, rows, bits, 64, dtype)
    for n, k in GPU_SHAPES
    for rows in (1, 2, 3, 4, 8)
    for bits in (4, 8)
    for dtype in (mx.bfloat16, mx.float16)
] + [
    (n, k, rows, bits, gs, mx.bfloat16)
    for n, k in GPU_SHAPES[:2]
    for rows in (1, 5)
    for bits in (4, 8)
    for gs in (32, 128)
]


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,rows,bits,gs,dtype", MMA_GPU_CASES)
def test_cuda_qmv_mma_matches_reference(n: int, k: int, rows: int, bits: int, gs: int, dtype) -> None:
    if backend() != "cuda":
        pytest.skip("needs the CUDA backend")
    w, s, b = _quantized(n, k, bits=bits, gs=gs, dtype=dtype, seed=n + k)
    x = mx.random.normal((rows, k)).astype(dtype)
    assert qmv_mma.supports_mma(x, w, s, b, group_size=gs, bits=bits)
    got = np.array(qmv_mma.qmv_mma(x, w, s, b, group_size=gs, bits=bits).astype(mx.float32))
    ref = _rounded_weight_reference(x, w, s, b, gs=gs, bits=bits)
    rtol = {mx.bfloat16: 2**-7, mx.float16: 2**-10}[dtype]
    np.testing.assert_allclose(got, ref, rtol=rtol, atol=1e-3 * np.abs(ref).max())


@pytest.mark.gpu
def test_cuda_qmv_fast_on_a_row_slice_and_through_qmv() -> None:
    """Row-sliced inputs (non-zero offsets) and the public qmv entry agree with the reference."""
    if backend() != "cuda":
        pytest.skip("needs the CUDA backend")
    w, s, b = _quantized(1024 + 13, 2048, bits=4, gs=64, dtype=mx.bfloat16)
    w, s, b = w[13:], s[13:], b[13:]
    x = mx.random.normal((6, 2048)).astype(mx.bfloat16)[2:5]
    ref = _precise_reference(x, w, s, b, gs=64, bits=4)
    for got in (qmv(x, w, s, b, group_size=64, bits=4), qmv_mma.qmv_mma(x, w, s, b, group_size=64, bits=4)):
        np.testing.assert_allclose(_np(got), ref, rtol=2**-6, atol=2e-3 * np.abs(ref).max())


# ---- Metal: the port is checked for consistency here, run only where Metal is ----

FIELD = re.compile(r"kq2_field\((w|hi), (0x[0-9A-F]+)u, ([0-9.e-]+)f, (-?[0-9.]+)f\)")


def test_metal_port_uses_the_cuda_constants_and_every_template_value() -> None:
    header, body = read_source("qmv.metal")
    assert FIELD.findall(header) == FIELD.findall(qmv_fast._KERNEL.header)
    x = mx.zeros((3, 5120), mx.bfloat16)
    template, grid, block = qmv_fast.metal_launch_config(x, 6144, group_size=64, bits=4)
    for name, _ in template:
        assert re.search(rf"\b{name}\b", body), name
    assert "thread_index_in_simdgroup" in body and "simd_sum" in body


@pytest.mark.parametrize("rows", range(1, 9))
@pytest.mark.parametrize("bits", [4, 8])
def test_metal_threadgroup_memory_fits(rows: int, bits: int, monkeypatch) -> None:
    """Where the port is used, its staged x fits 32 KiB; 4-bit with 7+ rows is left to stock."""
    monkeypatch.setattr(qmv_fast, "backend", lambda: "metal")
    w, s, b = _quantized(64, 2560, bits=bits, gs=64)
    assert qmv_fast.supports_fast(mx.zeros((rows, 2560)), w, s, b, group_size=64, bits=bits) == (
        bits == 8 or rows <= 6
    )
    if bits == 4 and rows > 6:
        return
    for k in (2560, 5120, 17408):
        template, _, _ = qmv_fast.metal_launch_config(mx.zeros((rows, k)), 64, group_size=64, bits=bits)
        smem = dict(template)["SMEM_FLOATS"]
        assert smem * 4 <= 32 * 1024 and smem % 4 == 0
        assert smem * 4 >= qmv_fast.shared_bytes(rows, k, bits, qmv_fast.METAL_SHARED_BUDGET)


def test_metal_layout_emulates_correctly() -> None:
    """The Metal budget's tiling (more, smaller tiles) gives the same result in the transcription."""
    w, s, b = _quantized(16, 17408 // 4, bits=4, gs=64)
    x = mx.random.normal((4, 17408 // 4))
    template, shared, _, _ = qmv_fast.launch_config(
        x, 16, group_size=64, bits=4, budget=qmv_fast.METAL_SHARED_BUDGET
    )
    got = emulate(np.array(x), np.array(w), np.array(s), np.array(b), template, shared)
    np.testing.assert_allclose(got, _precise_reference(x, w, s, b, gs=64, bits=4), rtol=1e-4, atol=1e-2)


def test_qmv_on_metal_uses_the_port_but_models_keep_stock(monkeypatch) -> None:
    w, s, b = _quantized(8, 256, bits=8, gs=64)
    calls = []
    monkeypatch.setattr(qmv_fast, "backend", lambda: "metal")
    monkeypatch.setattr(qmv_mod, "backend", lambda: "metal")
    monkeypatch.setattr(qmv_mod, "qmv_fast", lambda *a, **kw: calls.append("v2"))
    qmv(mx.zeros((3, 256)), w, s, b, group_size=64, bits=8)
    qmv(mx.zeros((12, 256)), w, s, b, group_size=64, bits=8)  # neither kernel: the reference
    assert calls == ["v2"]
    assert not qmv_mod.prefer_kernel(3, bits=8, mode="affine")


@pytest.mark.metal
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
def test_metal_qmv_fast_matches_reference(rows: int, bits: int, dtype) -> None:
    if backend() != "metal":
        pytest.skip("needs Metal")
    for n, k in ((2560, 2560), (1024 + 3, 9728)):
        w, s, b = _quantized(n, k, bits=bits, gs=64, dtype=dtype)
        x = mx.random.normal((rows, k)).astype(dtype)
        got = np.array(qmv_fast.qmv_fast(x, w, s, b, group_size=64, bits=bits).astype(mx.float32))
        ref = _precise_reference(x, w, s, b, gs=64, bits=bits)
        rtol = {mx.bfloat16: 2**-7, mx.float16: 2**-10, mx.float32: 1e-5}[dtype]
        np.testing.assert_allclose(got, ref, rtol=rtol, atol=1e-3 * np.abs(ref).max())


# ---- the tensor-core variant: its fragment bookkeeping, transcribed ----


def _round_to(values: np.ndarray, dtype) -> np.ndarray:
    """float -> bf16/fp16 (round to nearest even) -> float32, as the kernel's packing does."""
    if dtype == mx.float16:
        return values.astype(np.float16).astype(np.float32)
    bits_ = values.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits_ + 0x7FFF + ((bits_ >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32)


def _mma(c: np.ndarray, a: list, b: list) -> None:
    """mma.sync m16n8k16 on per-lane registers (each a (lo, hi) pair), PTX fragment layout."""
    big_a, big_b = np.zeros(c.shape[:-2] + (16, 16)), np.zeros(c.shape[:-2] + (16, 8))
    for lane in range(32):
        g, t = divmod(lane, 4)
        for reg, (row, col) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8))):
            big_a[..., row, col], big_a[..., row, col + 1] = a[lane][reg]
        for reg, k0 in enumerate((2 * t, 2 * t + 8)):
            big_b[..., k0, g], big_b[..., k0 + 1, g] = b[lane][reg]
    c += big_a @ big_b


def emulate_mma(x: np.ndarray, w: np.ndarray, s: np.ndarray, b: np.ndarray, template, dtype) -> np.ndarray:
    tp = dict(template)
    m_rows, n, k, gs, bits, tm_count, warps = (tp[key] for key in ("M", "N", "K", "GS", "BITS", "TM", "W"))
    ch = 128 // bits
    nch = k // ch
    nsteps = math.ceil(nch / 4)
    blocks = math.ceil(n / (16 * tm_count))
    chunks = w.reshape(n, nch, 4)
    # rows[block, tm, 16]: tile rows, clamped
    rows = np.minimum(np.arange(blocks * tm_count * 16).reshape(blocks, tm_count, 16), n - 1)
    red = np.zeros((warps, blocks, tm_count, 16, 8))
    for warp in range(warps):
        for step in range(warp, nsteps, warps):
            a_regs = {}  # (tm, mma index) -> per-lane registers
            b_regs = {}
            for lane in range(32):
                g, t = divmod(lane, 4)
                chunk = 4 * step + t
                cc = chunk if chunk < nch else 0
                live = g < m_rows and chunk < nch
                xs = x[g if g < m_rows else 0, cc * ch : (cc + 1) * ch] * live
                for tm in range(tm_count):
                    halves = []
                    for h in (0, 1):
                        r = rows[:, tm, g + 8 * h]
                        sc = s[r, cc * ch // gs][:, None]
                        bi = b[r, cc * ch // gs][:, None]
                        q = decode_word(chunks[r, cc], bits).reshape(blocks, ch)
                        if bits == 4:  # hfma2 in the pair type: one rounding of q * s + b
                            vals = _round_to(q * _round_to(sc, dtype) + _round_to(bi, dtype), dtype)
                        else:  # fmaf in float32, then packed
                            vals = _round_to((q * sc + bi).astype(np.float32), dtype)
                        halves.append(vals)
                    for word in range(4):
                        if bits == 4:
                            v = [
                                [hv[:, 8 * word + i], hv[:, 8 * word + i + 4]]
                                for hv in halves
                                for i in range(4)
                            ]
                            # v[h * 4 + i] = pair (value i, value i + 4) of row g + 8h
                            a_regs.setdefault((tm, 2 * word), {})[lane] = [v[0], v[4], v[1], v[5]]
                            a_regs.setdefault((tm, 2 * word + 1), {})[lane] = [v[2], v[6], v[3], v[7]]
                        else:
                            v = [
                                [hv[:, 4 * word + 2 * j], hv[:, 4 * word + 2 * j + 1]]
                                for hv in halves
                                for j in range(2)
                            ]
                            a_regs.setdefault((tm, word), {})[lane] = [v[0], v[2], v[1], v[3]]
                for word in range(4):
                    if bits == 4:
                        xw = xs[8 * word : 8 * word + 8]
                        b_regs.setdefault(2 * word, {})[lane] = [(xw[0], xw[4]), (xw[1], xw[5])]
                        b_regs.setdefault(2 * word + 1, {})[lane] = [(xw[2], xw[6]), (xw[3], xw[7])]
                    else:
                        xw = xs[4 * word : 4 * word + 4]
                        b_regs.setdefault(word, {})[lane] = [(xw[0], xw[1]), (xw[2], xw[3])]
            for (tm, idx), lanes in a_regs.items():
                _mma(
                    red[warp][:, tm],
                    [lanes[lane] for lane in range(32)],
                    [b_regs[idx][lane] for lane in range(32)],
                )
    total = red.sum(0)  # [blocks, tm, 16 rows, 8 columns]
    y = total.reshape(blocks * tm_count * 16, 8)[:n, :m_rows].T
    return y.astype(np.float32)


MMA_CASES = [(1, 37, 512, 4, 32), (3, 32, 1088, 4, 64), (8, 20, 1024, 8, 128), (5, 16, 640, 8, 32)]


@pytest.mark.parametrize("rows,n,k,bits,gs", MMA_CASES)
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_emulated_mma_kernel_matches_reference(rows: int, n: int, k: int, bits: int, gs: int, dtype) -> None:
    w, s, b = _quantized(n, k, bits=bits, gs=gs, dtype=dtype, seed=rows)
    x = mx.random.normal((rows, k)).astype(dtype)
    template, grid, block = qmv_mma.mma_launch_config(x, n, group_size=gs, bits=bits)
    assert block == 32 * qmv_mma.MMA_WARPS and grid // block * 16 * qmv_mma.MMA_TILES >= n
    got = emulate_mma(_np(x), np.array(w), _np(s), _np(b), template, dtype)
    ref = _rounded_weight_reference(x, w, s, b, gs=gs, bits=bits)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def _rounded_weight_reference(x, w, s, b, *, gs: int, bits: int) -> np.ndarray:
    """Weights s * q + b rounded once to x's dtype (what the tensor-core variant multiplies)."""
    f32 = mx.float32
    weights = mx.dequantize(w, s.astype(f32), b.astype(f32), group_size=gs, bits=bits).astype(x.dtype)
    return np.array(x.astype(f32) @ weights.astype(f32).T)


def test_mma_header_has_the_transcribed_constants() -> None:
    header = qmv_mma._MMA_KERNEL.header
    for snippet in (
        "0x000F000Fu) | 0x43004300u",
        "0x000F000Fu) | 0x64006400u",
        "0x7440u + 2 * j",
        "0x7441u + 2 * j",
    ):
        assert snippet in header, snippet
    source = qmv_mma._MMA_KERNEL.source
    for snippet in (
        "__byte_perm(u.x, u.z, 0x5410u), __byte_perm(u.x, u.z, 0x7632u)",
        "{p[0][0], p[1][0], p[0][1], p[1][1]}",
    ):
        assert snippet in source, snippet
