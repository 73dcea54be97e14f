"""The tensor-core mat-vec (kernels/matvec_tensor_core.py): its CUDA body compiled for sm_90 for every launched
variant, and executed on the CPU by the threads emulator of test_gdn_kernel.py, with `mma.sync`
emulated from its PTX fragment layout. GPU tests compare it with MLX's own quantized mat-mul."""

from __future__ import annotations

import shutil

import mlx.core as mx
import numpy as np
import pytest
from nvcc_check import assert_compiles, nvcc

from kapitsa.engine.kernels import backend
from kapitsa.engine.kernels import matvec_tensor_core as tc
from kapitsa.engine.kernels.matvec import qmv_reference
from tests.kernels.test_gdn_kernel import Emulated, cuda_translation

# mma.m16n8k16 (bf16 in, float32 out) on the host: each lane publishes its fragments, then reads
# everyone's to rebuild A (16x16) and B (16x8) and computes its own four outputs. The layout is the
# PTX ISA's: lane (g = lane/4, t = lane%4) holds A[g][2t..2t+1], A[g+8][2t..], A[g][2t+8..],
# A[g+8][2t+8..]; B[2t..2t+1][g], B[2t+8..2t+9][g]; D[g][2t..2t+1], D[g+8][2t..2t+1].
MMA_EMULATION = r"""
#define KAPITSA_EMULATE 1
inline uint32_t __byte_perm(uint32_t a, uint32_t b, uint32_t s) {
  const uint64_t v = ((uint64_t)b << 32) | a;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= (uint32_t)((v >> (8 * ((s >> (4 * i)) & 7))) & 0xFF) << (8 * i);
  return r;
}
template <typename P> inline P __ldcs(const P* p) { return *p; }
static uint32_t emu_frag[32][32][6];
inline float emu_bf(uint32_t reg, int half) { return __int_as_float((int)((half ? reg >> 16 : reg & 0xFFFF) << 16)); }
void kapitsa_emu_mma(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
  const int w = threadIdx.x / 32, l = threadIdx.x % 32;
  for (int i = 0; i < 4; ++i) emu_frag[w][l][i] = a[i];
  emu_frag[w][l][4] = b0;
  emu_frag[w][l][5] = b1;
  __syncwarp();
  float A[16][16], B[16][8];
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, t = lane % 4;
    const uint32_t* f = emu_frag[w][lane];
    for (int j = 0; j < 2; ++j) {
      A[g][2 * t + j] = emu_bf(f[0], j);
      A[g + 8][2 * t + j] = emu_bf(f[1], j);
      A[g][2 * t + 8 + j] = emu_bf(f[2], j);
      A[g + 8][2 * t + 8 + j] = emu_bf(f[3], j);
      B[2 * t + j][g] = emu_bf(f[4], j);
      B[2 * t + 8 + j][g] = emu_bf(f[5], j);
    }
  }
  __syncwarp();
  const int g = l / 4, t = l % 4;
  for (int k = 0; k < 16; ++k) {
    d[0] += A[g][k] * B[k][2 * t];
    d[1] += A[g][k] * B[k][2 * t + 1];
    d[2] += A[g + 8][k] * B[k][2 * t];
    d[3] += A[g + 8][k] * B[k][2 * t + 1];
  }
}
"""


def _translate(kernel, dtypes, output_dtypes, template):
    unit, function = cuda_translation(kernel, dtypes, output_dtypes, template)
    return MMA_EMULATION + unit, function


def _weights(n: int, k: int, gs: int, seed: int = 0):
    mx.random.seed(seed)
    w = mx.random.normal((n, k)) * 0.05
    q, s, b = mx.quantize(w.astype(mx.bfloat16), group_size=gs, bits=4)
    return q, s, b


LAUNCHED = [  # (rows, n, k, group size, tiles, exact_q): decode and verification shapes
    (1, 34816, 5120, 64, 2, True),
    (1, 5120, 17408, 64, 2, True),
    (8, 5120, 6144, 64, 2, True),
    (4, 16480, 5120, 128, 1, False),
    (3, 248320, 5120, 64, 1, True),
    (12, 5120, 6144, 64, 2, True),  # 9-16 rows: two 8-column blocks (longer drafts)
    (16, 34816, 5120, 64, 2, True),
    (16, 5120, 17408, 64, 2, False),
]


@pytest.mark.skipif(nvcc() is None, reason="needs nvcc")
@pytest.mark.parametrize("rows,n,k,gs,tiles,exact", LAUNCHED)
def test_cuda_source_compiles(rows, n, k, gs, tiles, exact) -> None:
    template, _, _ = tc.launch_config(rows, n, k, gs, tiles, exact)
    src = tc._KERNEL.render([mx.bfloat16, mx.uint32, mx.bfloat16, mx.bfloat16], [mx.bfloat16], template)
    assert_compiles(src)


def test_splits_fill_the_gpu_and_respect_groups() -> None:
    assert tc.splits_for(34816, 5120, 64, 2) == 2  # 1088 tiles
    assert tc.splits_for(5120, 17408, 64, 2) == 8  # 160 tiles: split K eight ways
    assert tc.splits_for(248320, 5120, 64, 2) == 1
    assert tc.splits_for(64, 64, 64, 2) == 1  # one group: nothing to split
    assert tc.splits_for(64, 128, 64, 2) == 2  # a group per split


@pytest.mark.skipif(shutil.which("g++") is None or nvcc() is None, reason="needs g++ and the CUDA headers")
@pytest.mark.parametrize(
    "rows,n,k,gs,tiles,exact",
    [
        (1, 48, 384, 64, 2, True),
        (3, 40, 384, 128, 1, False),
        (8, 32, 256, 64, 2, False),
        (5, 24, 640, 64, 1, True),
        (12, 40, 384, 64, 2, True),  # two blocks of x rows, K split four ways
        (16, 32, 512, 128, 1, False),
        (9, 24, 640, 64, 1, True),
    ],
)
def test_emulated_kernel_matches_reference(monkeypatch, tmp_path, rows, n, k, gs, tiles, exact) -> None:
    q, s, b = _weights(n, k, gs)
    x = (mx.random.normal((rows, k)) * 2).astype(mx.bfloat16)
    ref = qmv_reference(
        x.astype(mx.float32), q, s.astype(mx.float32), b.astype(mx.float32), group_size=gs, bits=4
    )
    monkeypatch.setattr(tc, "_KERNEL", Emulated(tc._KERNEL, _translate, tmp_path))
    got = tc.qmv_tensor_core(x, q, s, b, group_size=gs, tiles=tiles, exact_q=exact).astype(mx.float32)
    assert got.shape == (rows, n)
    err = float(mx.abs(got - ref).max() / mx.abs(ref).max())
    assert err < 8e-3, err  # the output is bf16: one rounding of ~0.4% at most per value


def test_supports() -> None:
    q, s, b = _weights(32, 128, 64)
    x = mx.zeros((1, 128), mx.bfloat16)
    assert tc.supports_tensor_core(x, q, s, b, group_size=64, bits=4) == (backend() == "cuda")
    x16, x17 = mx.zeros((16, 128), mx.bfloat16), mx.zeros((17, 128), mx.bfloat16)
    assert tc.supports_tensor_core(x16, q, s, b, group_size=64, bits=4) == (backend() == "cuda")
    assert not tc.supports_tensor_core(x17, q, s, b, group_size=64, bits=4)


@pytest.mark.gpu
@pytest.mark.skipif(backend() != "cuda", reason="needs the CUDA backend")
@pytest.mark.parametrize("rows", [1, 2, 4, 8, 12, 16])
@pytest.mark.parametrize(
    "n,k,gs", [(34816, 5120, 64), (5120, 17408, 64), (16480, 5120, 128), (5120, 6144, 64)]
)
@pytest.mark.parametrize("exact", [True, False])
def test_gpu_matches_stock(rows, n, k, gs, exact) -> None:
    q, s, b = _weights(n, k, gs)
    x = mx.random.normal((rows, k)).astype(mx.bfloat16)
    ref = qmv_reference(
        x.astype(mx.float32), q, s.astype(mx.float32), b.astype(mx.float32), group_size=gs, bits=4
    )
    got = tc.qmv_tensor_core(x, q, s, b, group_size=gs, exact_q=exact).astype(mx.float32)
    err = float(mx.abs(got - ref).max() / mx.abs(ref).max())
    assert err < 8e-3, err
    assert np.isfinite(np.array(got)).all()
