"""The MoE decode kernels' own CUDA sources and Metal ports (kernels/moe.py, moe_launch.py) run on the CPU under a
host emulation of the GPU, against the reference, and the launcher driving the emulated kernels."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kapitsa.engine.kernels import moe, moe_launch
from kapitsa.engine.kernels.moe import experts_decode_reference
from kapitsa.engine.ops.moe import SwitchGLU, SwitchReluSquared
from kapitsa.engine.options import KernelOptions
from kapitsa.errors import KapitsaError
from tests.kernels.test_moe_kernel import _module_path, _quantize_module, _routing, _stacks

# --- the CUDA sources themselves, run on CPU --------------------------------------------------
# The kernel bodies are compiled as C++ (g++) with one std::thread per CUDA thread: __shared__
# locals become function statics (one block runs at a time), __syncthreads a std::barrier, warp
# shuffles an exchange through a per-warp buffer between two per-warp barriers. Float32 only.

_EMULATION_PRELUDE = r"""
#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>
using std::min;
struct uint4 { uint32_t x, y, z, w; };
struct Idx { int x, y, z; };
static thread_local Idx threadIdx, blockIdx;
static Idx blockDim;
static std::barrier<>* g_block;
static std::barrier<>* g_warp[32];
static float g_lanes[32][32];
static std::atomic<int> g_or{0};
static float* g_dynamic;
static void __syncthreads() { g_block->arrive_and_wait(); }
static bool __syncthreads_or(bool v) {
  __syncthreads();
  if (v) g_or = 1;
  __syncthreads();
  const bool r = g_or.load();
  __syncthreads();
  if (threadIdx.x == 0) g_or = 0;
  return r;
}
static float __shfl_xor_sync(unsigned, float v, int o) {
  const int w = threadIdx.x / 32, l = threadIdx.x % 32;
  g_lanes[w][l] = v;
  g_warp[w]->arrive_and_wait();
  const float r = g_lanes[w][l ^ o];
  g_warp[w]->arrive_and_wait();
  return r;
}
"""

_EMULATION_LAUNCH = r"""
extern "C" void launch(int blocks_x, int blocks_y, int threads, long dynamic_floats, PARAMS) {
  std::vector<float> dynamic(dynamic_floats);
  g_dynamic = dynamic.data();
  std::barrier<> block(threads);
  g_block = &block;
  std::vector<std::unique_ptr<std::barrier<>>> warps;
  for (int w = 0; w < threads / 32; ++w) {
    warps.emplace_back(new std::barrier<>(32));
    g_warp[w] = warps.back().get();
  }
  blockDim = {threads, 1, 1};
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      threadIdx = {t, 0, 0};
      for (int by = 0; by < blocks_y; ++by)
        for (int bx = 0; bx < blocks_x; ++bx) {
          blockIdx = {bx, by, 0};
          body(ARGS);
          __syncthreads();  // the next block reuses the statics
        }
    });
  for (auto& th : pool) th.join();
}
"""


_METAL_AS_CPP = r"""
namespace metal { using std::exp; using std::max; using std::min; }
typedef unsigned uint;
typedef unsigned long ulong;
typedef unsigned short ushort;
static float simd_shuffle_xor(float v, int o) { return __shfl_xor_sync(0xffffffffu, v, o); }
"""


def _cuda_as_cpp(kernel) -> tuple[str, str]:
    """(header, body) of a CUDA kernel, its shared memory mapped onto the emulation."""
    body = kernel.source.replace("extern __shared__ float", "float* const").replace("__shared__", "static")
    return "", body.replace("xs[];", "xs = g_dynamic;").replace("hs[];", "hs = g_dynamic;")


def _metal_as_cpp(kind: str, which: str) -> tuple[str, str]:
    """(header, body) of metal/moe.metal's kernel, Metal spellings mapped onto the emulation."""
    import re

    from kapitsa.engine.kernels.metal import read_source

    header, bodies = read_source("moe.metal")
    hidden, out = bodies.split(moe_launch.OUT_BODY_MARKER, 1)
    nw = 2 if kind == "swiglu" else 1
    body = hidden.replace("WEIGHT_POINTERS", moe_launch._METAL_POINTERS[nw]) if which == "hidden" else out
    body = body.replace("threadgroup_barrier(mem_flags::mem_threadgroup)", "__syncthreads()")
    body = re.sub(r"^(\s*)threadgroup (int|float) ", r"\1static \2 ", body, flags=re.M)
    body = body.replace("threadgroup_position_in_grid", "blockIdx").replace(
        "thread_index_in_threadgroup", "threadIdx.x"
    )
    body = re.sub(r"\b(threadgroup|device) ", "", body)
    return _METAL_AS_CPP + header, body


def _emulated(names: tuple[str, ...], source: tuple[str, str], template: list, tmp_path, tag: str):
    """A ctypes function launch(blocks_x, blocks_y, threads, dynamic_floats, *pointers) running
    `source` = (header, body) with the given input+output names and template values."""
    import ctypes
    import shutil
    import subprocess

    if shutil.which("g++") is None:
        pytest.skip("g++ not installed")
    ctype = {"indices": "const uint32_t*", "indices_shape": "const int*", "h": "float*", "y": "float*"}
    params = [
        ctype.get(n, "const uint32_t*" if n.startswith("w") else "const float*") + f" {n}" for n in names
    ]
    consts = [
        f"using {n} = float;" if isinstance(v, mx.Dtype) else f"constexpr int {n} = {v};" for n, v in template
    ]
    header, body = source
    src = (
        _EMULATION_PRELUDE
        + header
        + "static void body("
        + ", ".join(params)
        + ") {\n"
        + "\n".join(consts)
        + body
        + "}\n"
        + _EMULATION_LAUNCH.replace("PARAMS", ", ".join(params)).replace("ARGS", ", ".join(names))
    )
    cpp, lib = tmp_path / f"{tag}.cpp", tmp_path / f"{tag}.so"
    cpp.write_text(src)
    proc = subprocess.run(
        ["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-w", "-o", str(lib), str(cpp)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return ctypes.CDLL(str(lib)).launch


def _ptr(a: np.ndarray):
    import ctypes

    return a.ctypes.data_as(ctypes.c_void_p)


def _with_shapes(names: tuple[str, ...], arrays: list[np.ndarray], source: tuple[str, str]):
    """(names, arrays) with `indices_shape` after `indices` where the body reads it: MLX passes
    the shape of an input whose `<name>_shape` the source names (here as an int array)."""
    if "indices_shape" not in source[1]:
        return names, arrays
    at = names.index("indices") + 1
    shape = np.array(arrays[at - 1].shape, np.int32)
    return (*names[:at], "indices_shape", *names[at:]), [*arrays[:at], shape, *arrays[at:]]


def _run_emulated(
    plan, x, idx, scores, first, second, tmp_path, budget: int, dialect: str = "cuda"
) -> np.ndarray:
    import ctypes

    t1 = plan.hidden_template(mx.float32, mx.float32, mx.uint32, budget=budget)
    weights = [np.ascontiguousarray(np.array(a)) for st in first for a in st]
    xn, idxn, scn = (np.ascontiguousarray(np.array(a)) for a in (x, idx, scores))
    h = np.full((plan.pairs, plan.hidden), np.nan, np.float32)
    kernel = moe_launch.hidden_kernel(plan.kind)
    source = _cuda_as_cpp(kernel) if dialect == "cuda" else _metal_as_cpp(plan.kind, "hidden")
    names, arrays = _with_shapes((*kernel.input_names, "h"), [xn, idxn, *weights, h], source)
    launch = _emulated(names, source, t1, tmp_path, "hidden")
    launch(
        plan.blocks(plan.hidden, t1), plan.pairs, dict(t1)["WARPS"] * 32, ctypes.c_long(plan.shared_bytes(t1, plan.rows) // 4),
        *(_ptr(a) for a in arrays),
    )  # fmt: skip
    t2 = plan.out_template(mx.float32, mx.float32, mx.uint32, mx.float32, budget=budget)
    y = np.full((plan.tokens, plan.n_out), np.nan, np.float32)
    source = _cuda_as_cpp(moe_launch.OUT_KERNEL) if dialect == "cuda" else _metal_as_cpp(plan.kind, "out")
    second = [np.ascontiguousarray(np.array(a)) for a in second]
    names, arrays = _with_shapes(
        (*moe_launch.OUT_KERNEL.input_names, "y"), [h, idxn, scn, *second, y], source
    )
    launch = _emulated(names, source, t2, tmp_path, "out")
    launch(
        plan.blocks(plan.n_out, t2), 1, dict(t2)["WARPS"] * 32, ctypes.c_long(plan.shared_bytes(t2, plan.rows * plan.k) // 4),
        *(_ptr(a) for a in arrays),
    )  # fmt: skip
    return y


_EMULATION_CASES = [  # (kind, bits, group, tokens, shared budget), slow?
    (("swiglu", 4, 32, 1, moe_launch.SHARED_BUDGET), True),
    (("swiglu", 4, 64, 4, 3 * 1024), False),  # small budget: several tiles; short rows: lanes split rows
    (("relu2", 8, 64, 3, moe_launch.SHARED_BUDGET), False),
    (("relu2", 4, 128, 5, 4 * 1024), True),
]


@pytest.mark.parametrize(
    "dialect,kind,bits,gs,tokens,budget",
    [
        pytest.param(
            dialect,
            *case,
            marks=[pytest.mark.slow] if slow or (dialect, case[0]) == ("metal", "relu2") else [],
        )
        for dialect in ("cuda", "metal")
        for case, slow in _EMULATION_CASES
    ],
)
def test_kernel_sources_run_on_cpu_emulation(dialect, kind, bits, gs, tokens, budget, tmp_path) -> None:
    """The CUDA bodies, and metal/moe.metal's bodies with Metal spellings mapped to C++ (checks
    the port's logic, not Metal's compiler)."""
    mx.random.seed(6)
    k, experts, d, hidden = 3, 6, 256, 128
    module = SwitchGLU(d, hidden, experts) if kind == "swiglu" else SwitchReluSquared(d, hidden, experts)
    _, first, second, _, _ = _stacks(_quantize_module(module, gs, bits))
    x = mx.random.normal((tokens, d))
    idx, scores = _routing(tokens, k, experts, seed=tokens, pool=4)
    if tokens > 1:  # a repeated expert within a token, and one the model does not have
        idx = mx.array(np.array(idx)[:, [0, 0, 2]] if tokens == 4 else np.array(idx))
        idx[tokens - 1, 2] = experts + 1
    plan = moe_launch.Plan(tokens, k, experts, d, hidden, d, bits, gs, kind)
    got = _run_emulated(plan, x, idx, scores, first, second, tmp_path, budget, dialect)
    known = mx.array(np.where(np.array(idx) < experts, np.array(scores), 0.0))
    safe_idx = mx.minimum(idx, experts - 1)  # the reference cannot take the unknown expert
    want = experts_decode_reference(x, safe_idx, known, first, second, kind=kind, group_size=gs, bits=bits)
    np.testing.assert_allclose(got, np.array(want), rtol=1e-4, atol=1e-4)


class _EmulatedKernel:
    """Stands in for a CudaKernel: same call signature, runs the body through the emulation, so
    the launcher's own input order, grid and shared memory size are what gets exercised."""

    def __init__(self, kernel, tmp_path) -> None:
        self.kernel, self.tmp_path, self.calls, self.templates, self.shapes = kernel, tmp_path, [], [], []

    def __call__(self, inputs, *, template, grid, threadgroup, output_shapes, output_dtypes, shared_memory):
        import ctypes

        tag = f"{self.kernel.name}_{len(self.calls)}"
        inputs = [np.ascontiguousarray(np.array(a)) for a in inputs]
        assert all(a.dtype in (np.float32, np.uint32) for a in inputs), [a.dtype for a in inputs]
        outs = [np.full(tuple(shape), np.nan, np.float32) for shape in output_shapes]
        source = _cuda_as_cpp(self.kernel)
        names = (*self.kernel.input_names, *self.kernel.output_names)
        names, arrays = _with_shapes(names, [*inputs, *outs], source)
        launch = _emulated(names, source, template, self.tmp_path, tag)
        assert grid[0] % threadgroup[0] == 0
        launch(grid[0] // threadgroup[0], grid[1], threadgroup[0], ctypes.c_long(shared_memory // 4),
               *(_ptr(a) for a in arrays))  # fmt: skip
        self.calls.append(shared_memory)
        self.templates.append(dict(template))
        self.shapes.append(([a.shape for a in inputs], [tuple(shape) for shape in output_shapes]))
        return [mx.array(o) for o in outs]


def test_capacity_is_the_next_power_of_two_within_the_pair_limit() -> None:
    assert [moe_launch.capacity_for(t, 8) for t in (1, 2, 3, 5, 8, 9)] == [
        1,
        2,
        4,
        8,
        8,
        9,
    ]  # 16 x 8 > 72 pairs
    assert [moe_launch.capacity_for(t, 3) for t in (3, 9, 16)] == [4, 16, 16]
    # a lower routing limit caps the capacity too: 5 tokens of 6 slots under 32 pairs compile for 5
    assert [moe_launch.capacity_for(t, 6, 32) for t in (1, 3, 4, 5)] == [1, 4, 4, 5]
    assert moe_launch.capacity_for(9, 8, 200) == 9  # never past what the kernels hold


@pytest.mark.parametrize("kind,tokens,capacity", [("swiglu", 3, 4), ("relu2", 5, 8), ("swiglu", 1, 2)])
def test_cuda_kernels_compiled_for_more_tokens_than_they_get(kind, tokens, capacity, tmp_path) -> None:
    """Compiled for `capacity` tokens (the template's M), run on fewer: the count comes from the
    indices' shape, so one compile serves every batch size up to its capacity."""
    mx.random.seed(7)
    k, experts, d, hidden, gs, bits = 3, 6, 256, 128, 64, 4
    module = SwitchGLU(d, hidden, experts) if kind == "swiglu" else SwitchReluSquared(d, hidden, experts)
    _, first, second, _, _ = _stacks(_quantize_module(module, gs, bits))
    x = mx.random.normal((tokens, d))
    idx, scores = _routing(tokens, k, experts, seed=tokens + 10, pool=4)
    plan = moe_launch.Plan(tokens, k, experts, d, hidden, d, bits, gs, kind, capacity)
    got = _run_emulated(plan, x, idx, scores, first, second, tmp_path, moe_launch.SHARED_BUDGET)
    want = experts_decode_reference(x, idx, scores, first, second, kind=kind, group_size=gs, bits=bits)
    np.testing.assert_allclose(got, np.array(want), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind,tokens", [("swiglu", 2), ("relu2", 3)])
def test_launcher_runs_the_emulated_kernels(kind: str, tokens: int, monkeypatch, tmp_path) -> None:
    """experts_decode / routed_experts with the CUDA backend, the kernels emulated on CPU (3
    tokens: compiled for a capacity of 4)."""
    mx.random.seed(8)
    d, hidden, experts, k = 128, 64, 6, 3
    module = SwitchGLU(d, hidden, experts) if kind == "swiglu" else SwitchReluSquared(d, hidden, experts)
    module = _quantize_module(module, 64, 8 if kind == "swiglu" else 4)
    x = mx.random.normal((1, tokens, d))
    idx, scores = _routing(tokens, k, experts, seed=8, pool=4)
    want = _module_path(module, x, idx[None], scores[None])
    hidden_k = _EmulatedKernel(moe_launch.hidden_kernel(kind), tmp_path)
    out_k = _EmulatedKernel(moe_launch.OUT_KERNEL, tmp_path)
    monkeypatch.setattr(moe, "backend", lambda: "cuda")
    monkeypatch.setattr(moe_launch, "hidden_kernel", lambda _kind: hidden_k)
    monkeypatch.setattr(moe_launch, "OUT_KERNEL", out_k)
    got = moe.routed_experts(module, x, idx[None], scores[None])
    assert got.shape == (1, tokens, d) and got.dtype == mx.float32
    assert hidden_k.calls and out_k.calls  # the kernels ran, not the fallback
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)
    with pytest.raises(KapitsaError, match="same leading shape"):
        moe.routed_experts(module, x, idx[None], scores[None][..., :2])


def test_routed_experts_past_max_pairs_takes_the_module_path(monkeypatch, tmp_path) -> None:
    """A model's limit (KernelOptions.moe_max_pairs) below the call's pairs: no kernel runs and the
    result is the module's; at the limit the kernels run, compiled for no more pairs than it allows
    (3 tokens of 3 slots: M = 3 under 9 pairs, the power of two 4 under 12); 0 turns them off."""
    mx.random.seed(9)
    d, hidden, experts, k, tokens = 128, 64, 6, 3, 3
    module = _quantize_module(SwitchGLU(d, hidden, experts), 64, 4)
    x = mx.random.normal((1, tokens, d))
    idx, scores = _routing(tokens, k, experts, seed=9, pool=4)
    hidden_k = _EmulatedKernel(moe_launch.hidden_kernel("swiglu"), tmp_path)
    out_k = _EmulatedKernel(moe_launch.OUT_KERNEL, tmp_path)
    monkeypatch.setattr(moe, "backend", lambda: "cuda")
    monkeypatch.setattr(moe_launch, "hidden_kernel", lambda _kind: hidden_k)
    monkeypatch.setattr(moe_launch, "OUT_KERNEL", out_k)
    for off in (tokens * k - 1, 0):
        got = moe.routed_experts(module, x, idx[None], scores[None], max_pairs=off)
        assert not hidden_k.calls and not out_k.calls
        assert mx.array_equal(got, _module_path(module, x, idx[None], scores[None]))
    for limit, capacity in ((tokens * k, 3), (12, 4)):
        moe.routed_experts(module, x, idx[None], scores[None], max_pairs=limit)
        assert hidden_k.templates[-1]["M"] == out_k.templates[-1]["M"] == capacity


def test_default_limit_keeps_the_kernels_to_two_tokens_of_top_8(monkeypatch, tmp_path) -> None:
    """Under the default options (KernelOptions().moe_max_pairs), 2 tokens of top-8 routing take
    the expert kernels and 3 tokens take gather_qmm, where the kernels measure slower (options.py)."""
    mx.random.seed(10)
    d, hidden, experts, k = 128, 64, 8, 8
    module = _quantize_module(SwitchGLU(d, hidden, experts), 64, 4)
    hidden_k = _EmulatedKernel(moe_launch.hidden_kernel("swiglu"), tmp_path)
    out_k = _EmulatedKernel(moe_launch.OUT_KERNEL, tmp_path)
    monkeypatch.setattr(moe, "backend", lambda: "cuda")
    monkeypatch.setattr(moe_launch, "hidden_kernel", lambda _kind: hidden_k)
    monkeypatch.setattr(moe_launch, "OUT_KERNEL", out_k)
    limit = KernelOptions().moe_max_pairs
    for tokens, kernels_run in ((2, True), (3, False)):
        launched = len(hidden_k.calls)
        x = mx.random.normal((1, tokens, d))
        idx, scores = _routing(tokens, k, experts, seed=tokens, pool=experts)
        got = moe.routed_experts(module, x, idx[None], scores[None], max_pairs=limit)
        assert (len(hidden_k.calls) > launched) is kernels_run
        want = _module_path(module, x, idx[None], scores[None])
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("lead", [(3, 1), (1, 2)])  # a decode step of 3 streams; a 2-token verify
def test_launcher_takes_the_step_shapes_without_reshapes(
    lead: tuple[int, int], monkeypatch, tmp_path
) -> None:
    """x and the scores reach the kernels as the step holds them and the output comes back in the
    step's shape (each reshape around them is a primitive the host pays every layer of every step);
    only a verify's indices, whose first axis is not the token count the kernels read, are reshaped."""
    mx.random.seed(11)
    d, hidden, experts, k = 128, 64, 6, 3
    tokens = lead[0] * lead[1]
    module = _quantize_module(SwitchGLU(d, hidden, experts), 64, 4)
    x = mx.random.normal((*lead, d))
    idx, scores = _routing(tokens, k, experts, seed=11, pool=4)
    idx, scores = idx.reshape(*lead, k), scores.reshape(*lead, k)
    hidden_k = _EmulatedKernel(moe_launch.hidden_kernel("swiglu"), tmp_path)
    out_k = _EmulatedKernel(moe_launch.OUT_KERNEL, tmp_path)
    monkeypatch.setattr(moe, "backend", lambda: "cuda")
    monkeypatch.setattr(moe_launch, "hidden_kernel", lambda _kind: hidden_k)
    monkeypatch.setattr(moe_launch, "OUT_KERNEL", out_k)
    got = moe.routed_experts(module, x, idx, scores)
    (hidden_in, _), (out_in, out_shapes) = hidden_k.shapes[-1], out_k.shapes[-1]
    index_shape = (*lead, k) if lead[1] == 1 else (tokens, k)
    assert hidden_in[:2] == [(*lead, d), index_shape]
    assert out_in[1:3] == [index_shape, (*lead, k)] and out_shapes == [(*lead, d)]
    want = _module_path(module, x, idx, scores)
    assert got.shape == want.shape == (*lead, d)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)
