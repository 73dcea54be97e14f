"""Kernel sources run on the CPU: each CUDA body (or Metal port) is translated to host C++ with one
std::thread per GPU thread and compiled with g++, so a test compares the kernel's own code with its
reference without a GPU. `Emulated` stands in for a module's kernel object."""

from __future__ import annotations

import pathlib
import re
import subprocess

import mlx.core as mx
import numpy as np

from kapitsa.engine.kernels.cuda import cuda_type, template_constants
from kapitsa.engine.kernels.metal import read_source

# Host C++ around the kernel body: one std::thread per CUDA thread, blocks one after another,
# __syncthreads / __syncwarp as barriers, __shfl_xor_sync through a per-warp exchange buffer,
# __shared__ arrays as statics (shared by the block's threads). The CUDA headers' bf16/fp16 types
# work on the host, so every rounding runs as on the device.
EMULATOR_PRELUDE = r"""
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <vector_types.h>
#include <vector_functions.h>
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <thread>
#include <vector>
#undef __device__
#define __device__
#undef __global__
#define __global__
#define __shared__ static
#define __grid_constant__
using std::min;
// MLX's `Shape` parameter (an input's shape, passed when the body names `<input>_shape`).
struct Shape { int32_t dims[10]; int32_t operator[](int i) const { return dims[i]; } };
struct EmuDim { unsigned x = 0, y = 0, z = 0; };
thread_local EmuDim threadIdx, blockIdx;
struct EmuBlock {
  std::unique_ptr<std::barrier<>> block;
  std::vector<std::unique_ptr<std::barrier<>>> warps;
  float exchange[32][32];
};
thread_local EmuBlock* emu = nullptr;
inline void __syncthreads() { emu->block->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu->warps[threadIdx.x / 32]->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int o) {
  const int w = threadIdx.x / 32, l = threadIdx.x % 32;
  emu->exchange[w][l] = v;
  __syncwarp();
  const float r = emu->exchange[w][l ^ o];
  __syncwarp();
  return r;
}
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
// Metal spellings, for the .metal port (address-space qualifiers are stripped before compiling).
using bfloat16_t = __nv_bfloat16;
using half = __half;
using uint = unsigned;
using ushort = unsigned short;
thread_local EmuDim threadgroup_position_in_grid;
thread_local unsigned thread_index_in_threadgroup;
namespace metal {
enum class mem_flags { mem_threadgroup };
inline float exp(float x) { return std::exp(x); }
inline float log(float x) { return std::log(x); }
inline float abs(float x) { return std::fabs(x); }
inline float rsqrt(float x) { return 1.f / std::sqrt(x); }
template <typename A> inline A max(A a, A b) { return a > b ? a : b; }
template <typename A> inline A min(A a, A b) { return a < b ? a : b; }
inline float simd_shuffle_xor(float v, ushort o) { return __shfl_xor_sync(0xffffffffu, v, o); }
}  // namespace metal
inline void threadgroup_barrier(metal::mem_flags) { __syncthreads(); }
template <typename To, typename From>
inline To as_type(From x) { To t; std::memcpy(&t, &x, sizeof t); return t; }
static std::vector<char> emu_read(const char* path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<char>((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}
"""


def cuda_translation(kernel, input_dtypes, output_dtypes, template) -> tuple[str, str]:
    """(source, function name): the rendered CUDA unit without MLX's includes."""
    body = kernel.render(input_dtypes, output_dtypes, template)
    for line in ('#include "mlx/backend/cuda/device/utils.cuh"\n', "#include <cooperative_groups.h>\n"):
        body = body.replace(line, "", 1)  # MLX's includes: the prelude stands in for them
    return body.replace(
        "namespace cg = cooperative_groups;\n", ""
    ), f"mlx::core::cu::{kernel.jit_name(template)}"


def metal_translation(kernel, input_dtypes, output_dtypes, template) -> tuple[str, str]:
    """(source, function name): the .metal header and body as host C++. Arrays declared
    `threadgroup` become statics (shared by the block's threads); other address-space qualifiers
    go; template arguments become constants as MLX's instantiation would bind them."""
    header, body = read_source(kernel.filename)
    body = re.sub(r"\bthreadgroup (\w+ \w+\[)", r"static \1", body)
    strip = r"\b(threadgroup|device|thread|constant) "
    header, body = re.sub(strip, "", header), re.sub(strip, "", body)
    params = [f"const {cuda_type(d)}* {n}" for n, d in zip(kernel.input_names, input_dtypes, strict=True)]
    params += [f"{cuda_type(d)}* {n}" for n, d in zip(kernel.output_names, output_dtypes, strict=True)]
    consts = [f"  {line}" for line in template_constants(template)]
    fn = "void emu_metal_kernel(" + ", ".join(params) + ") {\n" + "\n".join(consts) + body + "\n}\n"
    return header + fn, "emu_metal_kernel"


def emulator_source(
    unit: str, function: str, input_dtypes, output_dtypes, output_sizes, blocks, threads, input_shapes=None
) -> str:
    """EMULATOR_PRELUDE + a translated kernel + a main() that reads inputs from in<i>.bin, runs
    every block (one host thread per GPU thread) and writes out<i>.bin. `input_shapes[i]`:
    (shape or None, rank or None): the `Shape` and `int` parameters that follow that
    input's pointer (as MLX passes them)."""
    types = [f"const {cuda_type(d)}" for d in input_dtypes] + [cuda_type(d) for d in output_dtypes]
    n_in = len(input_dtypes)
    loads = "\n".join(f'  auto in{i} = emu_read("in{i}.bin");' for i in range(n_in))
    allocs = "\n".join(f"  std::vector<char> out{i}({size});" for i, size in enumerate(output_sizes))
    ptrs = []
    for i in range(n_in):
        ptrs.append(f"({types[i]}*)in{i}.data()")
        shape, rank = input_shapes[i] if input_shapes is not None else (None, None)
        if shape is not None:
            ptrs.append("Shape{{" + ", ".join(str(d) for d in shape) + "}}")
        if rank is not None:
            ptrs.append(str(rank))
    ptrs += [f"({types[n_in + i]}*)out{i}.data()" for i in range(len(output_sizes))]
    saves = "\n".join(
        f'  std::ofstream("out{i}.bin", std::ios::binary).write(out{i}.data(), {size});'
        for i, size in enumerate(output_sizes)
    )
    main = f"""
int main() {{
{loads}
{allocs}
  for (unsigned b = 0; b < {blocks}; ++b) {{
    EmuBlock block;
    block.block = std::make_unique<std::barrier<>>({threads});
    for (int w = 0; w < {threads // 32}; ++w) block.warps.push_back(std::make_unique<std::barrier<>>(32));
    std::vector<std::thread> pool;
    for (unsigned t = 0; t < {threads}; ++t) {{
      pool.emplace_back([&, t] {{
        emu = &block;
        threadIdx.x = thread_index_in_threadgroup = t;
        blockIdx.x = threadgroup_position_in_grid.x = b;
        {function}({", ".join(ptrs)});
      }});
    }}
    for (auto& th : pool) th.join();
  }}
{saves}
}}
"""
    return EMULATOR_PRELUDE + unit + main


_NP_TYPES = {mx.float32: np.float32, mx.uint32: np.uint32, mx.int32: np.int32}


class Emulated:
    """Stands in for gdn.CUDA_KERNEL / gdn.METAL_KERNEL: same call, runs the kernel's own source
    on the CPU through g++ (`translate` is cuda_translation or metal_translation)."""

    def __init__(self, kernel, translate, workdir: pathlib.Path):
        self.kernel, self.translate, self.workdir = kernel, translate, workdir

    def __call__(self, inputs, *, template, grid, threadgroup, output_shapes, output_dtypes, **_):
        threads = threadgroup[0]
        sizes = [int(np.prod(s)) * d.size for s, d in zip(output_shapes, output_dtypes, strict=True)]
        dtypes = [x.dtype for x in inputs]
        unit, function = self.translate(self.kernel, dtypes, output_dtypes, template)
        read, ranks = getattr(self.kernel, "shape_inputs", ()), getattr(self.kernel, "ndim_inputs", ())
        shapes = [
            (x.shape if n in read else None, x.ndim if n in ranks else None)
            for n, x in zip(self.kernel.input_names, inputs, strict=True)
        ]
        blocks = grid[0] // threads
        src = emulator_source(unit, function, dtypes, output_dtypes, sizes, blocks, threads, shapes)
        run = self.workdir / f"run{len(list(self.workdir.iterdir()))}"
        run.mkdir()
        (run / "k.cpp").write_text(src)
        cc = ["g++", "-std=c++20", "-O1", "-w", "-pthread", "-I/usr/local/cuda/include", "k.cpp", "-o", "k"]
        proc = subprocess.run(cc, cwd=run, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-4000:]
        for i, x in enumerate(inputs):
            raw = x.view(mx.uint16) if x.dtype in (mx.bfloat16, mx.float16) else x
            np.array(raw).tofile(run / f"in{i}.bin")
        proc = subprocess.run(["./k"], cwd=run, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        outs = []
        for i, (shape, dtype) in enumerate(zip(output_shapes, output_dtypes, strict=True)):
            if dtype in (mx.bfloat16, mx.float16):
                raw = np.fromfile(run / f"out{i}.bin", np.uint16)
                outs.append(mx.array(raw).view(dtype).reshape(shape))
            else:
                raw = np.fromfile(run / f"out{i}.bin", _NP_TYPES.get(dtype, np.float32))
                outs.append(mx.array(raw).reshape(shape))
        return outs


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


HOST_INTRINSICS = (
    MMA_EMULATION
    + r"""
inline float __uint_as_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float __expf(float x) { return std::exp(x); }
"""
)


def cuda_host_translation(kernel, dtypes, output_dtypes, template):
    """cuda_translation with the intrinsics the mat-vec, router and attention kernels use on the host."""
    unit, function = cuda_translation(kernel, dtypes, output_dtypes, template)
    return HOST_INTRINSICS + unit, function
