"""The Mamba-2 step's exact CUDA and Metal kernel bodies (kernels/mamba.py) run on the CPU under a
small C++ host emulation of the GPU execution model (one std::thread per GPU thread, barriers for
__syncthreads / threadgroup_barrier and for warp shuffles / simd_sum), compared with the reference."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import tempfile

import mlx.core as mx
import numpy as np
import pytest

from kapitsa.engine.kernels import mamba as mk
from kapitsa.engine.kernels.cuda import template_constants

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from tests.kernels.test_mamba_kernel import INF, _ragged, assert_matches, make_inputs

# -- the kernel bodies under a host emulation of the GPU execution model ------------------------
#
# Each kernel body becomes a plain C++ function with the same parameters and constants; every GPU
# thread is a std::thread, a block's shared memory is a function-level static (one block runs at
# a time), __syncthreads / threadgroup_barrier is a block-wide std::barrier, and warp shuffles /
# simd_sum exchange values through a per-warp buffer between two per-warp barriers.

CUDA_INCLUDE = pathlib.Path("/usr/local/cuda/include")
needs_gxx = pytest.mark.skipif(
    shutil.which("g++") is None or not (CUDA_INCLUDE / "cuda_bf16.h").is_file(),
    reason="needs g++ and the CUDA headers",
)

# Before any prelude: the Metal one defines macros (`thread`, `device`) the C++ library would trip on.
_STD_INCLUDES = r"""
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>
using HostThread = std::thread;
"""

_CUDA_PRELUDE = r"""
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <vector_types.h>
#undef __device__
#undef __forceinline__
#undef __shared__
#define __device__
#define __forceinline__ inline
#define __shared__ static
struct Dim3 { unsigned x, y, z; };
thread_local Dim3 threadIdx;
Dim3 blockIdx;
void set_block(unsigned x, unsigned y, unsigned z) { blockIdx = {x, y, z}; }
void set_thread(unsigned t) { threadIdx = {t, 0, 0}; }
unsigned thread_id() { return threadIdx.x; }
void block_sync();
float warp_exchange(float v, unsigned from_lane);
inline void __syncthreads() { block_sync(); }
inline float __shfl_xor_sync(unsigned, float v, int offset) { return warp_exchange(v, (threadIdx.x % 32) ^ offset); }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
using std::min;
"""

_METAL_PRELUDE = r"""
typedef unsigned long ulong;
typedef _Float16 half;
struct bfloat16_t {  // round-to-nearest-even, as Metal's bfloat conversion
  uint16_t bits;
  bfloat16_t() = default;
  bfloat16_t(float f) { uint32_t u; std::memcpy(&u, &f, 4); bits = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16; }
  operator float() const { uint32_t u = uint32_t(bits) << 16; float f; std::memcpy(&f, &u, 4); return f; }
};
struct float2 { float x, y; float2() = default; float2(float a, float b) : x(a), y(b) {} };
struct float4 {
  float x, y, z, w;
  float4() = default;
  float4(float a, float b, float c, float d) : x(a), y(b), z(c), w(d) {}
};
struct uint3 { unsigned x, y, z; };
#define device
#define constant
#define thread
#define threadgroup static
namespace metal {
using std::abs; using std::exp; using std::fma; using std::log;
inline float max(float a, float b) { return std::fmax(a, b); }
inline float min(float a, float b) { return std::fmin(a, b); }
inline int min(int a, int b) { return std::min(a, b); }
inline float rsqrt(float x) { return 1.f / std::sqrt(x); }
}
enum class mem_flags { mem_threadgroup };
template <class T> T as_type(int i) { T f; std::memcpy(&f, &i, 4); return f; }
uint3 threadgroup_position_in_grid;
thread_local unsigned thread_index_in_threadgroup;
void set_block(unsigned x, unsigned y, unsigned z) { threadgroup_position_in_grid = {x, y, z}; }
void set_thread(unsigned t) { thread_index_in_threadgroup = t; }
unsigned thread_id() { return thread_index_in_threadgroup; }
void block_sync();
float warp_exchange(float v, unsigned from_lane);
inline void threadgroup_barrier(mem_flags) { block_sync(); }
float warp_sum(float v);
inline float simd_sum(float v) { return warp_sum(v); }
"""

_RUNTIME = r"""
static std::unique_ptr<std::barrier<>> block_barrier;
static std::unique_ptr<std::barrier<>> warp_barrier[32];
static float lanes[32][32];
void block_sync() { block_barrier->arrive_and_wait(); }
float warp_exchange(float v, unsigned from_lane) {
  const unsigned w = thread_id() / 32, l = thread_id() % 32;
  lanes[w][l] = v;
  warp_barrier[w]->arrive_and_wait();
  const float other = lanes[w][from_lane];
  warp_barrier[w]->arrive_and_wait();
  return other;
}
float warp_sum(float v) {
  const unsigned w = thread_id() / 32, l = thread_id() % 32;
  lanes[w][l] = v;
  warp_barrier[w]->arrive_and_wait();
  float total = 0.f;
  for (unsigned i = 0; i < 32; ++i) total += lanes[w][i];
  warp_barrier[w]->arrive_and_wait();
  return total;
}
template <class F> void launch(unsigned gx, unsigned gy, unsigned gz, unsigned threads, F body) {
  for (unsigned z = 0; z < gz; ++z)
    for (unsigned y = 0; y < gy; ++y)
      for (unsigned x = 0; x < gx; ++x) {
        set_block(x, y, z);
        block_barrier = std::make_unique<std::barrier<>>(threads);
        for (unsigned w = 0; w < threads / 32; ++w) warp_barrier[w] = std::make_unique<std::barrier<>>(32);
        std::vector<HostThread> pool;
        for (unsigned t = 0; t < threads; ++t) pool.emplace_back([t, &body] { set_thread(t); body(); });
        for (auto& th : pool) th.join();
      }
}
template <class T> struct Buffer {  // not std::vector: vector<bool> has no data()
  std::unique_ptr<T[]> values;
  size_t size;
  explicit Buffer(size_t n) : values(new T[n]()), size(n) {}
  T* data() { return values.get(); }
};
template <class T> Buffer<T> load(const char* path, size_t n) {
  Buffer<T> v(n);
  FILE* f = std::fopen(path, "rb");
  if (!f || std::fread(v.data(), sizeof(T), n, f) != n) { std::perror(path); std::exit(2); }
  std::fclose(f);
  return v;
}
template <class T> void save(const char* path, Buffer<T>& v) {
  FILE* f = std::fopen(path, "wb");
  std::fwrite(v.data(), sizeof(T), v.size, f);
  std::fclose(f);
}
"""

_TYPES = {
    "cuda": {mx.float32: "float", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.bool_: "bool"},
    "metal": {mx.float32: "float", mx.float16: "half", mx.bfloat16: "bfloat16_t", mx.bool_: "bool"},
}


def _emulated_function(name, source, names, dtypes, template, types) -> str:
    """A kernel as a plain host function: the same parameter list, constants and body."""
    inputs, outputs = names
    in_dtypes, out_dtypes = dtypes
    params = [f"const {types[d]}* {n}" for n, d in zip(inputs, in_dtypes, strict=True)]
    params += [f"{types[d]}* {n}" for n, d in zip(outputs, out_dtypes, strict=True)]
    consts = template_constants(template, types.__getitem__)
    return f"void {name}({', '.join(params)}) {{\n" + "\n".join(consts) + source + "}\n"


def _raw(a: mx.array) -> np.ndarray:
    """Bytes as the kernel sees them (bf16/fp16 as their 16-bit patterns)."""
    if a.dtype in (mx.bfloat16, mx.float16):
        return np.array(a.view(mx.uint16))
    return np.array(a)


def _kernel_sources(which: str) -> tuple[str, str, str, str]:
    """(prelude, header, step body, norm body) for one backend's kernels."""
    if which == "cuda":
        step, norm = mk.cuda_kernels()
        return _CUDA_PRELUDE, step.header, step.source, norm.source
    header, step, norm = mk.metal_sources()
    return _METAL_PRELUDE, header, step, norm


def _main(inputs, gate_dt, norm_dt, B, T, d: mk.Dims, types) -> str:
    """main(): load the inputs, launch both kernels with `_launch`'s grids, save the outputs."""
    rows = mk.rows_per_block(T)
    inner, n_state = d.inner, B * d.heads * d.head_dim * d.state_size
    lines = ["int main() {"]
    for i, (a, name) in enumerate(zip(inputs, mk.STEP_INPUTS, strict=True)):
        lines.append(f'auto {name} = load<{types[a.dtype]}>("in{i}.bin", {a.size});')
    lines.append(f'auto gate = load<{types[gate_dt]}>("gate.bin", {B * T * inner});')
    lines.append(f'auto norm_w = load<{types[norm_dt]}>("norm_w.bin", {inner});')
    lines.append(f"Buffer<float> y({B * T * inner}), state_out({n_state});")
    lines.append(f"Buffer<{types[gate_dt]}> out({B * T * inner});")
    call = ", ".join(f"{n}.data()" for n in (*mk.STEP_INPUTS, *mk.STEP_OUTPUTS))
    lines.append(f"launch({d.head_dim // rows}, {d.heads}, {B}, {rows // mk.ROWS_PER_WARP * 32},")
    lines.append(f"       [&] {{ step_fn({call}); }});")
    lines.append(f"launch({d.groups}, {B * T}, 1, {mk.NORM_THREADS},")
    lines.append("       [&] { norm_fn(y.data(), gate.data(), norm_w.data(), out.data()); });")
    lines.append('save("state_out.bin", state_out); save("out.bin", out);\nreturn 0;\n}')
    return "\n".join(lines)


def emulate_step(which: str, args: dict, dims: dict, mask=None) -> tuple[mx.array, mx.array]:
    """Run one backend's two kernel bodies on the host, launched as `_launch` launches them."""
    types = _TYPES[which]
    d = mk.Dims(**dims)
    B, T = args["dt"].shape[:2]
    has_bias, gate_dt, norm_dt = args["conv_bias"] is not None, args["gate"].dtype, args["norm_weight"].dtype
    bias = args["conv_bias"] if has_bias else mx.zeros((1,), args["conv_in"].dtype)
    inputs = [args["conv_in"], args["conv_weight"], bias, args["dt"], args["dt_bias"], args["A_log"]]
    inputs += [args["D"], args["state"].astype(mx.float32), mx.ones((1,), mx.bool_) if mask is None else mask]
    step_t = mk.step_template(
        T, args["conv_weight"].shape[1], d, has_bias=has_bias, has_mask=mask is not None, which=which
    )
    prelude, header, step, norm = _kernel_sources(which)
    source = "\n".join(
        [
            _STD_INCLUDES,
            prelude,
            _RUNTIME,
            header,
            _emulated_function(
                "step_fn",
                step,
                (mk.STEP_INPUTS, mk.STEP_OUTPUTS),
                ([a.dtype for a in inputs], [mx.float32, mx.float32]),
                step_t,
                types,
            ),  # fmt: skip
            _emulated_function(
                "norm_fn",
                norm,
                (mk.NORM_INPUTS, mk.NORM_OUTPUTS),
                ([mx.float32, gate_dt, norm_dt], [gate_dt]),
                mk.norm_template(gate_dt, d),
                types,
            ),  # fmt: skip
            _main(inputs, gate_dt, norm_dt, B, T, d, types),
        ]
    )
    with tempfile.TemporaryDirectory() as tmp:
        folder = pathlib.Path(tmp)
        (folder / "emu.cpp").write_text(source)
        for i, a in enumerate(inputs):
            _raw(a).tofile(folder / f"in{i}.bin")
        _raw(args["gate"]).tofile(folder / "gate.bin")
        _raw(args["norm_weight"]).tofile(folder / "norm_w.bin")
        cmd = ["g++", "-std=c++20", "-O1", "-pthread", "-w", "-I", str(CUDA_INCLUDE), "emu.cpp", "-o", "emu"]
        built = subprocess.run(cmd, cwd=folder, capture_output=True, text=True)
        assert built.returncode == 0, built.stderr[-4000:]
        ran = subprocess.run(["./emu"], cwd=folder, capture_output=True, text=True, timeout=300)
        assert ran.returncode == 0, ran.stderr
        state = np.fromfile(folder / "state_out.bin", np.float32)
        raw_out = np.fromfile(folder / "out.bin", np.float32 if gate_dt == mx.float32 else np.uint16)
    out = mx.array(raw_out) if gate_dt == mx.float32 else mx.array(raw_out).view(gate_dt)
    return out.reshape(B, T, d.inner), mx.array(state).reshape(B, d.heads, d.head_dim, d.state_size)


EMULATION_CASES = [
    ((4, 32, 2, 64), 1, 3, mx.float32, False, True, (0.0, INF)),  # float2 lanes
    ((1, 32, 1, 128), 2, 17, mx.bfloat16, True, True, (0.0, INF)),  # two token chunks, 32 rows
    ((2, 32, 1, 96), 2, 5, mx.float16, True, False, (0.0, INF)),  # scalar lanes, no conv bias
    ((8, 64, 2, 128), 1, 1, mx.bfloat16, False, True, (0.001, 0.1)),  # decode, dt clipped
]
MIXED = ((4, 32, 2, 64), 2, 2, mx.bfloat16, True, True, (0.0, INF))  # float32 parameters, bf16 rest


@needs_gxx
@pytest.mark.parametrize("which", ["cuda", "metal"])
@pytest.mark.parametrize("shape,B,T,dtype,masked,bias,limit", EMULATION_CASES)
def test_kernel_bodies_match_reference_under_emulation(
    which, shape, B, T, dtype, masked, bias, limit
) -> None:
    args, dims = make_inputs(B, T, shape, dtype, bias=bias)
    dims["time_step_limit"] = limit
    mask = _ragged(B, T) if masked else None
    out, state = emulate_step(which, args, dims, mask)
    assert_matches(out, state, args, dims, mask)


@needs_gxx
def test_cuda_body_with_float32_parameters_under_emulation() -> None:
    shape, B, T, dtype, _, _, _ = MIXED
    args, dims = make_inputs(B, T, shape, dtype, param_dtype=mx.float32)
    mask = _ragged(B, T)
    out, state = emulate_step("cuda", args, dims, mask)
    assert_matches(out, state, args, dims, mask)
