"""Compile a rendered kernel with nvcc for sm_90 (H200) without running it: catches syntax and
type errors before spending device time. Used by tests/kernels/test_cuda_compile.py.

The kernel's `#include "mlx/backend/cuda/device/utils.cuh"` resolves to the stand-in the disk
cache compiles against (cuda_disk_cache.UTILS_STAND_IN), so every kernel checked here also builds
against it; `cuda_stub/` supplies MLX's device/config.h."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import tempfile

from kapitsa.engine.kernels.cuda_disk_cache import UTILS_STAND_IN

STUB = pathlib.Path(__file__).parent / "cuda_stub"


def nvcc() -> str | None:
    return shutil.which("nvcc")


def include_args(tmp: str) -> list[str]:
    """nvcc's -I options for a rendered kernel, writing the stand-in utils.cuh under `tmp`."""
    utils = pathlib.Path(tmp) / "include" / "mlx" / "backend" / "cuda" / "device" / "utils.cuh"
    utils.parent.mkdir(parents=True, exist_ok=True)
    utils.write_text(UTILS_STAND_IN)
    return ["-I", str(pathlib.Path(tmp) / "include"), "-I", str(STUB)]


def compile_source(source: str) -> tuple[bool, str]:
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "kernel.cu"
        path.write_text(source)
        proc = subprocess.run(
            [
                nvcc(),
                "-arch=sm_90",
                "-std=c++17",
                "--ptx",
                *include_args(tmp),
                "-o",
                str(path.with_suffix(".ptx")),
                str(path),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        return proc.returncode == 0, proc.stdout + proc.stderr


def assert_compiles(source: str) -> None:
    """`source` compiles for sm_90 with no error and no warning (the log's tail says why not)."""
    ok, log = compile_source(source)
    assert ok, log[-4000:]
    assert "warning" not in log.lower(), log[-4000:]
