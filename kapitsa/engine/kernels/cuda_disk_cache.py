"""Custom kernels compiled once per machine instead of once per process, through MLX's PTX cache.

MLX compiles every `mx.fast.cuda_kernel` instantiation with NVRTC in each process (about a second
each; a model's decode path has 20-30 of them) and never stores the result: custom kernels pass
`use_disk_cache=false` (mlx/backend/cuda/custom_kernel.cpp). Its JIT does read the disk cache
first for every module, custom ones included (jit_module.cpp, `JitModule::JitModule`): a module
found there as `<module>.ptx` (a cubin or PTX) plus `<module>.txt` (name, tab, lowered name) is
loaded, not compiled. So before an instantiation's first launch in a process, `prepare` works out
the module name MLX will look for (`<jit name>_<std::hash of the generated source, hex>`), and
when the file is missing (or was not built for this MLX and GPU: `build_tag`) it compiles that
same source with NVRTC and writes it there: each compile in a child process, up to eight at once,
where MLX would compile one after another (one process's NVRTC does too: nvrtc.py).

The source is MLX's, byte for byte (`CudaKernel.render`). The header it includes,
`mlx/backend/cuda/device/utils.cuh`, is embedded in libmlx and not shipped, so NVRTC gets a
stand-in with what kernel bodies may use from it: the CUDA half and bfloat16 types, libcu++'s
array and limits, and the `Shape`/`Strides` parameter types, sized by MLX's own
`device/config.h`. MLX finds the kernel by the lowered name the `.txt` records, so what must
match is the parameter layout. Anything that fails (no NVRTC, a body that needs more of MLX's
header, a cache MLX does not read) leaves that instantiation to MLX's own compile.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import logging
import os
import pathlib
import sys
import tempfile
import threading
import time

import mlx.core as mx

from kapitsa.engine.kernels import nvrtc

log = logging.getLogger(__name__)

UTILS_STAND_IN = """#pragma once
#include "mlx/backend/cuda/device/config.h"
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cuda/std/limits>
#include <cuda/std/tuple>
namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, MAX_NDIM>;
using Strides = cuda::std::array<int64_t, MAX_NDIM>;
}
"""
_HEADERS = {"mlx/backend/cuda/device/utils.cuh": UTILS_STAND_IN}
_MASK = (1 << 64) - 1
_MUL = 0xC6A4A7935BD1E995
_SEED = 0xC70F6907
_MAX_FILE_NAME = 245  # jit_module.cpp, `get_ptx_path`


def std_hash(data: bytes) -> int:
    """libstdc++'s `std::hash<std::string>` on 64-bit (`_Hash_bytes`, seed 0xc70f6907), the hash
    MLX puts in a custom kernel's module name."""
    length = len(data)
    value = (_SEED ^ (length * _MUL)) & _MASK
    aligned = length & ~7
    for i in range(0, aligned, 8):
        word = int.from_bytes(data[i : i + 8], "little")
        value = ((value ^ (_shift_mix((word * _MUL) & _MASK) * _MUL)) * _MUL) & _MASK
    if length & 7:
        tail = int.from_bytes(data[aligned:], "little")
        value = ((value ^ tail) * _MUL) & _MASK
    return _shift_mix((_shift_mix(value) * _MUL) & _MASK)


def _shift_mix(value: int) -> int:
    return value ^ (value >> 47)


def module_name(jit_name: str, source: str) -> str:
    return f"{jit_name}_{std_hash(source.encode()):x}"


def mlx_cache_dir() -> pathlib.Path | None:
    """Where MLX's JIT looks for compiled modules: $MLX_PTX_CACHE_DIR, else
    <temp dir>/mlx/<version>/ptx (jit_module.cpp, `ptx_cache_dir`); None when the variable is set
    empty, which turns MLX's disk cache off."""
    configured = os.environ.get("MLX_PTX_CACHE_DIR")
    if configured is not None:
        return pathlib.Path(configured) if configured else None
    return pathlib.Path(tempfile.gettempdir()) / "mlx" / mx.__version__ / "ptx"


def module_path(directory: pathlib.Path, name: str) -> pathlib.Path:
    """`<directory>/<name>.ptx`; a name over 245 characters is cut into folders as MLX cuts it."""
    path = directory
    while len(name) > _MAX_FILE_NAME:
        path, name = path / name[:_MAX_FILE_NAME], name[_MAX_FILE_NAME:]
    return path / f"{name}.ptx"


def build_tag(options: list[str]) -> str:
    """What a module written here was built for: the MLX version (the parameter layout its loader
    passes), the target architecture and the stand-in header. A module's name covers only its
    source, so a `.ptx` whose sidecar (`<module>.kapitsa`: this tag and the binary's digest) does
    not match is rebuilt: one left by another MLX or GPU, or cut short, would load and run wrong
    or not load at all. MLX reads the folder without looking at the sidecar, so one folder serves
    one MLX version and GPU architecture (the opener's `keep_jit_cache` makes it so)."""
    arch = [o for o in options if o.startswith("--gpu-architecture=")]
    digest = hashlib.sha256(UTILS_STAND_IN.encode()).hexdigest()[:12]
    return f"mlx {mx.__version__} {' '.join(arch)} stand-in {digest}\n"


class DiskCache:
    """Compiles missing modules into `directory` with `compiler` for one GPU architecture."""

    def __init__(self, directory: pathlib.Path, compiler: nvrtc.Nvrtc, options: list[str]) -> None:
        self.directory = directory
        self._compiler = compiler
        self._options = options
        self.tag = build_tag(options)

    def has(self, jit_name: str, source: str) -> bool:
        """Whether MLX will find a whole module built for this MLX and GPU (`build_tag`)."""
        return self._current(module_path(self.directory, module_name(jit_name, source)))

    def ensure(self, jit_name: str, source: str) -> bool:
        """Make MLX find `jit_name`'s module for `source` on disk; True when this call compiled it.
        Callers may race on one module (threads, processes): each writes whole files, the last
        rename wins, and the files are the same."""
        name = module_name(jit_name, source)
        path = module_path(self.directory, name)
        if self._current(path):
            return False
        symbol = f"mlx::core::cu::{jit_name}"
        compiled = self._compiler.compile(
            source,
            filename=f"{name}.cu",
            name_expressions=[symbol],
            options=self._options,
            headers=_HEADERS,
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_atomic(path.with_suffix(".txt"), f"{symbol}\t{compiled.lowered_names[symbol]}\n".encode())
        _write_atomic(path, compiled.binary)  # after the .txt: MLX takes a module once its .ptx is there
        _write_atomic(path.with_suffix(".kapitsa"), self._sidecar(compiled.binary).encode())
        return True

    def _sidecar(self, binary: bytes) -> str:
        return f"{self.tag}sha256 {hashlib.sha256(binary).hexdigest()}\n"

    def _current(self, path: pathlib.Path) -> bool:
        """Whether `path` holds a whole module built for this tag (read once per process)."""
        try:
            return path.with_suffix(".kapitsa").read_text() == self._sidecar(path.read_bytes())
        except OSError:
            return False


def _write_atomic(path: pathlib.Path, data: bytes) -> None:
    """Write, flush to disk, then rename: a reader sees the whole file or none (a short temp name:
    a module's own name may take most of the 255 bytes a file name may have)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise


def compile_options(
    compiler: nvrtc.Nvrtc, capability: tuple[int, int], include_dirs: list[pathlib.Path]
) -> list[str]:
    """MLX's NVRTC options for this GPU: SASS (`sm_XY`, `a` from compute capability 9 on) when
    this NVRTC can emit it, else PTX (`compute_XY`)."""
    major, minor = capability
    kind = "sm" if major * 10 + minor in compiler.supported_archs() else "compute"
    suffix = "a" if major >= 9 else ""
    return [
        "--device-as-default-execution-space",
        f"--gpu-architecture={kind}_{major}{minor}{suffix}",
        *(f"--include-path={d}" for d in include_dirs),
    ]


def include_dirs(mlx_root: pathlib.Path, nvrtc_major: int) -> list[pathlib.Path]:
    """MLX's NVRTC include path (jit_module.cpp, `include_path_args`): its bundled headers, CCCL,
    then the CUDA headers of the `nvidia` Python package beside it, else $CUDA_HOME/$CUDA_PATH,
    else /usr/local/cuda. Without a bundled CCCL, the toolkit's (`include/cccl` from CUDA 13 on)."""
    cuda = mlx_root.parent / "nvidia" / ("cu13" if nvrtc_major >= 13 else "cuda_runtime") / "include"
    if not cuda.is_dir():
        home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
        cuda = pathlib.Path(home) / "include"
    cccl = mlx_root / "include" / "cccl"
    if not cccl.is_dir():
        cccl = cuda / "cccl"
    return [d for d in (mlx_root / "include", cccl) if d.is_dir()] + [cuda]


@functools.cache
def default_cache() -> DiskCache | None:
    """The cache for this process's GPU, or None when there is none to fill (no CUDA, no NVRTC
    loaded, a cache folder that cannot be made)."""
    if not mx.cuda.is_available():
        return None
    try:
        library = nvrtc.loaded_library("libnvrtc.so")
        if library is None:
            return None
        compiler = nvrtc.Nvrtc(library)
        libmlx = nvrtc.loaded_library("libmlx.so")
        mlx_root = pathlib.Path(libmlx).parent.parent if libmlx else pathlib.Path(mx.__file__).parent
        directory = mlx_cache_dir()
        if directory is None:
            return None
        directory.mkdir(parents=True, exist_ok=True)
        dirs = include_dirs(mlx_root, compiler.version()[0])
        options = compile_options(compiler, nvrtc.compute_capability(), dirs)
        return DiskCache(directory, _side_by_side(compiler), options)
    except Exception as error:  # noqa: BLE001 - the cache only saves time; inference goes on without it
        log.warning("custom kernels compile in every process: %s", error)
        return None


def _side_by_side(compiler: nvrtc.Nvrtc) -> nvrtc.Nvrtc | nvrtc.IsolatedNvrtc:
    """Compiles that run side by side: each in a child process (nvrtc.IsolatedNvrtc) where this
    Python's interpreter can run one (`nvrtc.runs_children`); else in this process."""
    if sys.executable and nvrtc.runs_children(sys.executable):
        return nvrtc.IsolatedNvrtc(compiler.path, python=sys.executable)
    log.info("custom kernels compile in this process, one at a time: no interpreter for child compiles")
    return compiler


def prepare(jit_name: str, source: str) -> None:
    """Before a first launch in this process: a module already on disk is left to MLX to load; a
    missing one is compiled by a worker (`_compilers`), so the new kernels of one graph
    compile side by side while MLX's JIT, which compiles one module at a time, works down the
    graph and loads each that is ready when it gets there (one it reaches first, it compiles
    itself). A failure is logged once per kernel and leaves the compile to MLX."""
    cache = default_cache()
    if cache is None:
        return
    try:
        if cache.has(jit_name, source):
            return
    except Exception as error:  # noqa: BLE001 - as above: MLX compiles this one itself
        log.warning("kernel %s compiles in-process (MLX's JIT): %s", jit_name, str(error)[:2000])
        return
    with _PENDING_LOCK:
        _PENDING[:] = [f for f in _PENDING if not f.done()]  # a server runs for days: keep only live ones
        _PENDING.append(_compilers().submit(_ensure, cache, jit_name, source))


# The longest a caller waits for the compiles it handed over before it runs their kernels anyway
# (MLX then compiles what is missing itself): a fresh machine's take seconds to a minute
WAIT_LIMIT_S = 300.0


def compiles_running(wait_s: float = 0.0) -> bool:
    """Whether compiles that `prepare` started are still running, after waiting up to `wait_s` for
    them. A warm-up that built its steps ahead runs them once none is: MLX then finds every module
    on disk instead of compiling the first it reaches itself, one after another."""
    with _PENDING_LOCK:
        running = [f for f in _PENDING if not f.done()]
    if running and wait_s > 0:
        concurrent.futures.wait(running, timeout=wait_s)
    return any(not f.done() for f in running)


def cancel_queued() -> int:
    """Cancel the compiles no worker has started (an engine that stops: a process exiting would
    otherwise wait for each, a child process apiece); MLX compiles any still needed itself.
    Returns how many were cancelled."""
    with _PENDING_LOCK:
        cancelled = sum(f.cancel() for f in _PENDING)
        _PENDING[:] = [f for f in _PENDING if not f.done()]
    return cancelled


def drain(timeout_s: float | None = None) -> None:
    """Wait for the compiles `prepare` started, at most `timeout_s` in all (None: until done)."""
    with _PENDING_LOCK:
        pending = list(_PENDING)
        _PENDING.clear()
    concurrent.futures.wait(pending, timeout=timeout_s)  # `_ensure` raises nothing: no result to read


def _ensure(cache: DiskCache, jit_name: str, source: str) -> None:
    started = time.perf_counter()
    try:
        compiled = cache.ensure(jit_name, source)
    except Exception as error:  # noqa: BLE001 - as above: MLX compiles this one itself
        log.warning("kernel %s compiles in-process (MLX's JIT): %s", jit_name, str(error)[:2000])
        return
    if compiled:  # what a first start on a machine spends its time on
        log.info("kernel %s compiled into the disk cache (%.1f s)", jit_name, time.perf_counter() - started)


_PENDING: list[concurrent.futures.Future] = []
_PENDING_LOCK = threading.Lock()


@functools.cache
def _compilers() -> concurrent.futures.ThreadPoolExecutor:
    """Threads that each wait on one compile's child process (nvrtc.IsolatedNvrtc): 2 to 8 at once
    by the cores (each child holds a few hundred MB while it compiles)."""
    workers = max(2, min(8, os.cpu_count() or 1))
    return concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="nvrtc")
