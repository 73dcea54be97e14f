"""The custom-kernel disk cache: MLX's exact JIT source and module name, the files MLX reads, and a
real NVRTC compile where a libnvrtc is found (the GPU machine; $KAPITSA_TEST_NVRTC elsewhere).
tests/kernels/test_cuda_disk_cache_gpu.py checks on the GPU that MLX loads what this writes."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import threading
import time

import mlx.core as mx
import pytest

from kapitsa.engine.kernels import cuda, cuda_disk_cache, nvrtc
from kapitsa.engine.kernels.cuda import CudaKernel

# std::hash<std::string> from g++ 13 (libstdc++) on x86-64, printed with std::hex
LIBSTDCXX_HASHES = {
    b"": 0x553E93901E462A6E,
    b"a": 0x454DDEE488C1ED6B,
    b"abcdefg": 0xDEEE6830A3AF82AF,
    b"abcdefgh": 0x783DB3E38DB898BB,
    b"abcdefghi": 0xB4EC9257851C8AAF,
    bytes(range(256)) + bytes(range(44)): 0x5F4918EF1B28F196,
}

KERNEL = CudaKernel(
    "probe",
    ("x", "meta"),
    ("y",),
    "// a comment MLX never sees\n  const int n = x_shape[0];\n  y[0] = x[0] * N + meta[x_ndim];\n",
)


def test_std_hash_matches_libstdcxx() -> None:
    for data, want in LIBSTDCXX_HASHES.items():
        assert cuda_disk_cache.std_hash(data) == want, data[:16]


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_std_hash_matches_this_machines_compiler(tmp_path: pathlib.Path) -> None:
    """Every tail length (0-7 bytes past a word) and a kernel-sized text, against g++ here."""
    program = tmp_path / "h.cpp"
    program.write_text(
        "#include <iostream>\n#include <iterator>\n#include <string>\n"
        "int main() { std::string s((std::istreambuf_iterator<char>(std::cin)), {});"
        " std::cout << std::hex << std::hash<std::string>{}(s); }\n"
    )
    subprocess.run(["g++", "-O1", "-o", str(tmp_path / "h"), str(program)], check=True)
    for data in [os.urandom(n) for n in (*range(17), 1000, 6133)]:
        out = subprocess.run([str(tmp_path / "h")], input=data, capture_output=True, check=True).stdout
        assert cuda_disk_cache.std_hash(data) == int(out, 16)


def test_render_is_mlx_build_kernel_byte_for_byte() -> None:
    """custom_kernel.cpp's `build_kernel`: the default header, the compacted body, shape and rank
    parameters for inputs whose names the body reads (none for rank 0), template constants."""
    template = [("T", mx.bfloat16), ("N", 3), ("GATE", True)]
    want = (
        '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
        "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
        "__global__ void custom_kernel_probe_bfloat16_t_3_t(\n"
        "    const float* x,\n"
        "    const __grid_constant__ Shape x_shape,\n"
        "    const __grid_constant__ int x_ndim,\n"
        "    const int32_t* meta,\n"
        "    __nv_bfloat16* y) {\n"
        "  using T = __nv_bfloat16;\n  constexpr int N = 3;\n  constexpr bool GATE = true;\n\n"
        "const int n = x_shape[0];\ny[0] = x[0] * N + meta[x_ndim];\n"
        "\n}\n\n} // namespace mlx::core::cu\n"
    )
    assert KERNEL.render([mx.float32, mx.int32], [mx.bfloat16], template, [2, 1]) == want
    scalar = KERNEL.render([mx.float32, mx.int32], [mx.bfloat16], template, [0, 1])
    assert "x_shape," not in scalar and "x_ndim," not in scalar


def test_jit_name_tags_each_template_value_as_mlx_does() -> None:
    template = [("A", 7), ("B", False), ("C", mx.float16), ("D", mx.uint32), ("E", mx.float32)]
    assert KERNEL.jit_name(template) == "custom_kernel_probe_7_f_float16_t_uint32_t_float"
    assert KERNEL.jit_name([]) == "custom_kernel_probe"


def test_module_path_cuts_long_names_into_folders_as_mlx_does(tmp_path: pathlib.Path) -> None:
    assert cuda_disk_cache.module_path(tmp_path, "k_1f") == tmp_path / "k_1f.ptx"
    name = "a" * 245 + "b" * 245 + "c" * 10
    assert cuda_disk_cache.module_path(tmp_path, name) == tmp_path / ("a" * 245) / ("b" * 245) / (
        "c" * 10 + ".ptx"
    )


def test_cache_dir_follows_mlx(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    assert cuda_disk_cache.mlx_cache_dir() == tmp_path
    monkeypatch.delenv("MLX_PTX_CACHE_DIR")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    assert cuda_disk_cache.mlx_cache_dir() == tmp_path / "mlx" / mx.__version__ / "ptx"


class FakeCompiler:
    def __init__(self, fail: bool = False) -> None:
        self.calls, self.fail = [], fail

    def compile(self, source, *, filename, name_expressions, options, headers):
        self.calls.append((source, filename, tuple(name_expressions), tuple(options), dict(headers)))
        if self.fail:
            raise nvrtc.NvrtcError("NVRTC_ERROR_COMPILATION: boom")
        return nvrtc.Compiled(b"\x7fELF cubin", {n: f"_Z{len(n)}mangled" for n in name_expressions})


def test_ensure_writes_the_module_once_with_its_lowered_name(tmp_path: pathlib.Path) -> None:
    compiler = FakeCompiler()
    cache = cuda_disk_cache.DiskCache(tmp_path, compiler, ["--gpu-architecture=sm_90a"])
    source = KERNEL.render([mx.float32, mx.int32], [mx.float32], [("N", 2)], [1, 1])
    assert cache.ensure("custom_kernel_probe_2", source) is True
    assert cache.ensure("custom_kernel_probe_2", source) is False
    assert len(compiler.calls) == 1
    _, _, names, options, headers = compiler.calls[0]
    assert names == ("mlx::core::cu::custom_kernel_probe_2",)
    assert options == ("--gpu-architecture=sm_90a",)
    assert headers == {"mlx/backend/cuda/device/utils.cuh": cuda_disk_cache.UTILS_STAND_IN}
    stem = f"custom_kernel_probe_2_{cuda_disk_cache.std_hash(source.encode()):x}"
    assert (tmp_path / f"{stem}.ptx").read_bytes() == b"\x7fELF cubin"
    txt = (tmp_path / f"{stem}.txt").read_text()
    assert txt == "mlx::core::cu::custom_kernel_probe_2\t_Z36mangled\n"
    digest = hashlib.sha256(b"\x7fELF cubin").hexdigest()
    tag = cuda_disk_cache.build_tag(["--gpu-architecture=sm_90a"])
    assert (tmp_path / f"{stem}.kapitsa").read_text() == f"{tag}sha256 {digest}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{stem}.kapitsa", f"{stem}.ptx", f"{stem}.txt"]


def test_a_module_not_built_for_this_mlx_and_gpu_is_rebuilt(tmp_path: pathlib.Path) -> None:
    """A .ptx with no tag (left by something else) or another architecture's tag is compiled again;
    MLX would otherwise load it as it is."""
    compiler = FakeCompiler()
    source = KERNEL.render([mx.float32, mx.int32], [mx.float32], [("N", 2)], [1, 1])
    path = cuda_disk_cache.module_path(tmp_path, cuda_disk_cache.module_name("custom_kernel_probe_2", source))
    path.write_bytes(b"foreign")
    sm90 = cuda_disk_cache.DiskCache(tmp_path, compiler, ["--gpu-architecture=sm_90a"])
    assert sm90.ensure("custom_kernel_probe_2", source) and path.read_bytes() == b"\x7fELF cubin"
    sm80 = cuda_disk_cache.DiskCache(tmp_path, compiler, ["--gpu-architecture=sm_80"])
    assert sm80.ensure("custom_kernel_probe_2", source)
    assert not sm80.ensure("custom_kernel_probe_2", source)
    assert len(compiler.calls) == 2
    path.write_bytes(path.read_bytes()[:-3])  # cut short (a crash, a full disk): MLX could not load it
    assert sm80.ensure("custom_kernel_probe_2", source) and path.read_bytes() == b"\x7fELF cubin"


def test_mlx_disk_cache_turned_off_means_no_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """MLX_PTX_CACHE_DIR set empty: MLX reads no modules, so none is written."""
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", "")
    assert cuda_disk_cache.mlx_cache_dir() is None
    monkeypatch.setattr(cuda_disk_cache.mx.cuda, "is_available", lambda: True)
    monkeypatch.setattr(nvrtc, "loaded_library", lambda stem: "/lib/libnvrtc.so.13")
    monkeypatch.setattr(nvrtc, "Nvrtc", lambda path: FakeCompiler())
    cuda_disk_cache.default_cache.cache_clear()
    try:
        assert cuda_disk_cache.default_cache() is None
    finally:
        cuda_disk_cache.default_cache.cache_clear()


def test_a_failed_write_leaves_no_file_and_the_next_process_rebuilds(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The .ptx's rename fails (a full disk, a kill): no temp file stays, nothing passes for a
    module, and a later `ensure` compiles it again."""
    compiler = FakeCompiler()
    cache = cuda_disk_cache.DiskCache(tmp_path, compiler, [])
    replace, calls = os.replace, []

    def failing_second(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError("No space left on device")
        replace(src, dst)

    monkeypatch.setattr(cuda_disk_cache.os, "replace", failing_second)
    with pytest.raises(OSError, match="No space"):
        cache.ensure("custom_kernel_probe", "src")
    assert [p.suffix for p in tmp_path.iterdir()] == [".txt"]
    monkeypatch.setattr(cuda_disk_cache.os, "replace", replace)
    assert cache.ensure("custom_kernel_probe", "src") and len(compiler.calls) == 2
    assert not cache.ensure("custom_kernel_probe", "src")


def test_a_failed_compile_is_logged_and_left_to_mlx(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cache = cuda_disk_cache.DiskCache(tmp_path, FakeCompiler(fail=True), [])
    monkeypatch.setattr(cuda_disk_cache, "default_cache", lambda: cache)
    with caplog.at_level(logging.WARNING):
        cuda_disk_cache.prepare("custom_kernel_probe", "src")  # logged, not raised: MLX compiles it
        cuda_disk_cache.drain()
    assert "custom_kernel_probe compiles in-process" in caplog.text and "boom" in caplog.text


def test_each_compile_is_logged_with_its_time(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A slow first start says which kernels it compiled; a module found on disk says nothing."""
    cache = cuda_disk_cache.DiskCache(tmp_path, FakeCompiler(), [])
    monkeypatch.setattr(cuda_disk_cache, "default_cache", lambda: cache)
    source = KERNEL.render([mx.float32, mx.int32], [mx.float32], [("N", 3)], [1, 1])
    with caplog.at_level(logging.INFO, logger=cuda_disk_cache.__name__):
        cuda_disk_cache.prepare("custom_kernel_probe_3", source)
        cuda_disk_cache.drain()
        cuda_disk_cache._ensure(cache, "custom_kernel_probe_3", source)  # on disk now: not compiled again
    lines = [r.getMessage() for r in caplog.records if "compiled into the disk cache" in r.getMessage()]
    assert (
        len(lines) == 1 and lines[0].startswith("kernel custom_kernel_probe_3 compiled") and " s)" in lines[0]
    )


def test_any_failure_to_set_the_cache_up_leaves_the_compile_to_mlx(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """No NVRTC of the expected API (a missing symbol is an AttributeError) must not stop a model."""
    monkeypatch.setattr(cuda_disk_cache.mx.cuda, "is_available", lambda: True)
    monkeypatch.setattr(nvrtc, "loaded_library", lambda stem: "/lib/libnvrtc.so.13")

    class Broken:
        def __init__(self, path: str) -> None:
            raise AttributeError("nvrtcGetSupportedArchs")

    monkeypatch.setattr(nvrtc, "Nvrtc", Broken)
    cuda_disk_cache.default_cache.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            assert cuda_disk_cache.default_cache() is None
            cuda_disk_cache.prepare("custom_kernel_probe", "src")
    finally:
        cuda_disk_cache.default_cache.cache_clear()
    assert "custom kernels compile in every process: nvrtcGetSupportedArchs" in caplog.text


def test_prepare_compiles_missing_modules_side_by_side(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """New kernels of one graph compile at once on worker threads (at least two); `prepare` returns
    at once, and a module already on disk is not compiled again."""
    import threading

    started = threading.Barrier(2, timeout=10)

    class SlowCompiler(FakeCompiler):
        def compile(self, source, **kwargs):
            started.wait()  # two compile at the same time, or this times out
            return super().compile(source, **kwargs)

    compiler = SlowCompiler()
    cache = cuda_disk_cache.DiskCache(tmp_path, compiler, [])
    monkeypatch.setattr(cuda_disk_cache, "default_cache", lambda: cache)
    monkeypatch.setattr(
        cuda_disk_cache, "_compilers", functools.cache(cuda_disk_cache._compilers.__wrapped__)
    )
    for n in range(2):
        cuda_disk_cache.prepare(f"custom_kernel_probe_{n}", f"src {n}")
    cuda_disk_cache.drain()
    assert sorted(c[1].split("_")[3] for c in compiler.calls) == ["0", "1"]
    cuda_disk_cache.prepare("custom_kernel_probe_1", "src 1")
    cuda_disk_cache.drain()
    assert len(compiler.calls) == 2


def test_each_instantiation_is_prepared_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the first launch of each (template, input dtypes/ranks, output dtypes) goes through
    the disk cache with MLX's source; repeats cost a set lookup."""
    prepared, launched = [], []
    monkeypatch.setattr(cuda, "backend", lambda: "cuda")
    monkeypatch.setattr(cuda, "_PREPARED", set())
    monkeypatch.setattr(cuda_disk_cache, "prepare", lambda name, source: prepared.append((name, source)))
    monkeypatch.setattr(cuda, "_compiled", lambda kernel, smem: lambda **kw: launched.append(kw) or [])
    x, meta = mx.zeros((4, 2)), mx.zeros((3,), dtype=mx.int32)
    call = dict(grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(1,)], output_dtypes=[mx.float32])
    for n in (2, 2, 3, 2):
        KERNEL([x, meta], template=[("N", n)], **call)
    KERNEL([x.astype(mx.float16), meta], template=[("N", 2)], **call)
    assert [name for name, _ in prepared] == [
        "custom_kernel_probe_2",
        "custom_kernel_probe_3",
        "custom_kernel_probe_2",
    ]
    assert prepared[0][1] == KERNEL.render([mx.float32, mx.int32], [mx.float32], [("N", 2)], [2, 1])
    assert "const __half* x" in prepared[2][1]
    assert len(launched) == 5
    KERNEL([1.5, meta], template=[("N", 2)], **call)  # a Python scalar MLX takes: MLX compiles it
    assert len(prepared) == 3 and len(launched) == 6


def _nvrtc_library() -> str | None:
    if path := os.environ.get("KAPITSA_TEST_NVRTC") or nvrtc.loaded_library("libnvrtc.so"):
        return path
    try:
        import nvidia  # the CUDA wheels' namespace package

        found = sorted(pathlib.Path(list(nvidia.__path__)[0]).glob("*/lib/libnvrtc.so*"))
    except ImportError:
        return None
    return str(found[0]) if found else None


def _include_dirs() -> list[pathlib.Path] | None:
    """MLX's include path, with this repository's stand-in for device/config.h when the CPU wheel
    (which ships no CUDA headers) is installed; None without CUDA's own headers."""
    libmlx = nvrtc.loaded_library("libmlx.so")
    root = pathlib.Path(libmlx).parent.parent if libmlx else pathlib.Path(mx.__file__).parent
    dirs = cuda_disk_cache.include_dirs(root, 13)
    if not (dirs[-1] / "cuda_bf16.h").exists():
        return None
    if (root / "include" / "mlx" / "backend" / "cuda" / "device" / "config.h").exists():
        return dirs
    return [pathlib.Path(__file__).parent / "cuda_stub", *dirs]


@pytest.mark.skipif(_nvrtc_library() is None or _include_dirs() is None, reason="no libnvrtc or CUDA headers")
def test_nvrtc_builds_real_kernels_against_the_stand_in(tmp_path: pathlib.Path) -> None:
    """The attention kernels (shape parameters, bfloat16, cooperative groups) compile to a sm_90a
    cubin whose .txt names the symbol NVRTC lowered: what MLX's loader asks the module for."""
    from kapitsa.engine.kernels import attention

    compiler = nvrtc.Nvrtc(_nvrtc_library())
    options = cuda_disk_cache.compile_options(compiler, (9, 0), _include_dirs())
    assert "--gpu-architecture=sm_90a" in options
    cache = cuda_disk_cache.DiskCache(tmp_path, compiler, options)
    partial, combine = attention._templates(mx.bfloat16, 256, 4, 16, 256**-0.5, True)
    dtype = mx.bfloat16
    for kernel, inputs, outputs, template in (
        (attention._PARTIAL, [dtype] * 5 + [mx.int32], [mx.float32, mx.float32], partial),
        (attention._COMBINE, [mx.float32, mx.float32, dtype], [dtype], combine),
    ):
        source = kernel.render(inputs, outputs, template, [4] * len(inputs))
        assert cache.ensure(kernel.jit_name(template), source)
        path = cuda_disk_cache.module_path(
            tmp_path, cuda_disk_cache.module_name(kernel.jit_name(template), source)
        )
        assert path.read_bytes()[:4] == b"\x7fELF"
        name, mangled = path.with_suffix(".txt").read_text().rstrip("\n").split("\t")
        assert name == f"mlx::core::cu::{kernel.jit_name(template)}"
        assert mangled.startswith("_ZN3mlx4core2cu") and kernel.jit_name(template) in mangled
    with pytest.raises(nvrtc.NvrtcError, match="undefined_symbol"):
        cache.ensure(
            "custom_kernel_broken",
            CudaKernel("broken", ("x",), ("y",), "y[0] = undefined_symbol;").render(
                [mx.float32], [mx.float32], []
            ),
        )


@pytest.mark.skipif(_nvrtc_library() is None or _include_dirs() is None, reason="no libnvrtc or CUDA headers")
def test_a_child_process_compiles_what_this_process_does() -> None:
    """nvrtc.IsolatedNvrtc (what the disk cache compiles with) returns this process's NVRTC
    output: the same cubin and lowered name for one of kapitsa's kernels, wrapped as MLX wraps it."""
    from kapitsa.engine.kernels import attention

    here = nvrtc.Nvrtc(_nvrtc_library())
    options = cuda_disk_cache.compile_options(here, (9, 0), _include_dirs())
    _, combine = attention._templates(mx.bfloat16, 256, 4, 16, 256**-0.5, True)
    source = attention._COMBINE.render([mx.float32, mx.float32, mx.bfloat16], [mx.bfloat16], combine, [4] * 3)
    names = [f"mlx::core::cu::{attention._COMBINE.jit_name(combine)}"]
    arguments = {"filename": "combine.cu", "name_expressions": names, "options": options}
    headers = {"headers": dict(cuda_disk_cache._HEADERS)}
    child = nvrtc.IsolatedNvrtc(_nvrtc_library()).compile(source, **arguments, **headers)
    assert child == here.compile(source, **arguments, **headers)
    assert child.binary[:4] == b"\x7fELF"


def test_compiles_run_in_child_processes_where_an_interpreter_can_start_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    compiler = FakeCompiler()
    compiler.path = "/lib/libnvrtc.so.13"
    isolated = cuda_disk_cache._side_by_side(compiler)
    assert isinstance(isolated, nvrtc.IsolatedNvrtc) and isolated.path == "/lib/libnvrtc.so.13"
    assert isolated.python == sys.executable
    monkeypatch.setattr(nvrtc, "runs_children", lambda python: False)  # e.g. the host of an embedded one
    assert cuda_disk_cache._side_by_side(compiler) is compiler
    monkeypatch.setattr(cuda_disk_cache.sys, "executable", "")  # no interpreter named at all
    assert cuda_disk_cache._side_by_side(compiler) is compiler


def test_compiles_running_says_when_the_workers_are_done(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()

    class Slow(FakeCompiler):
        def compile(self, source, **kwargs):
            release.wait(10)
            return super().compile(source, **kwargs)

    cache = cuda_disk_cache.DiskCache(tmp_path, Slow(), [])
    monkeypatch.setattr(cuda_disk_cache, "default_cache", lambda: cache)
    cuda_disk_cache.prepare("custom_kernel_probe", "src")
    assert cuda_disk_cache.compiles_running() and cuda_disk_cache.compiles_running(0.05)
    release.set()
    assert not cuda_disk_cache.compiles_running(5.0)
    assert cache.has("custom_kernel_probe", "src")


def test_an_engine_that_stops_cancels_the_compiles_no_worker_started(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More compiles queued than workers: those not started are cancelled (MLX compiles any still
    needed itself), the running ones finish, and nothing is left pending."""
    release, entered = threading.Event(), []

    class Slow(FakeCompiler):
        def compile(self, source, **kwargs):
            entered.append(source)
            release.wait(10)
            return super().compile(source, **kwargs)

    compiler = Slow()
    cache = cuda_disk_cache.DiskCache(tmp_path, compiler, [])
    monkeypatch.setattr(cuda_disk_cache, "default_cache", lambda: cache)
    workers = cuda_disk_cache._compilers()._max_workers
    for i in range(workers + 3):
        cuda_disk_cache.prepare(f"custom_kernel_probe_{i}", f"src {i}")
    for _ in range(500):  # every worker busy with one
        if len(entered) == workers:
            break
        time.sleep(0.01)
    assert len(entered) == workers and cuda_disk_cache.cancel_queued() == 3
    release.set()
    assert not cuda_disk_cache.compiles_running(5.0)
    assert len(compiler.calls) == workers
