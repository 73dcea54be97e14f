"""nvrtc.IsolatedNvrtc: each compile in a child process that imports only the standard library, and
every way a child can fail comes back as an NvrtcError (the disk cache then leaves the kernel to
MLX's own compile). The round trip through a real NVRTC is in test_cuda_disk_cache.py."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from kapitsa.engine.kernels import nvrtc

REQUEST = {"filename": "k.cu", "name_expressions": ["k"], "options": [], "headers": {"a.h": "int a;"}}


def _compile(compiler: nvrtc.IsolatedNvrtc) -> nvrtc.Compiled:
    return compiler.compile("__global__ void k() {}", **REQUEST)


def test_a_library_the_child_cannot_load_is_named_in_the_error() -> None:
    with pytest.raises(nvrtc.NvrtcError, match="/nonexistent/libnvrtc.so"):
        _compile(nvrtc.IsolatedNvrtc("/nonexistent/libnvrtc.so"))


def test_no_interpreter_to_start_is_an_nvrtc_error() -> None:
    compiler = nvrtc.IsolatedNvrtc("/lib/libnvrtc.so", python="/nonexistent/python3")
    with pytest.raises(nvrtc.NvrtcError, match="NVRTC's child process"):
        _compile(compiler)


def test_a_child_that_exits_without_a_reply_is_an_nvrtc_error(tmp_path: pathlib.Path) -> None:
    dies = tmp_path / "dies"
    dies.write_text("#!/bin/sh\necho 'Segmentation fault' >&2\nexit 139\n")
    dies.chmod(0o755)
    with pytest.raises(nvrtc.NvrtcError, match="status 139: Segmentation fault"):
        _compile(nvrtc.IsolatedNvrtc("/lib/libnvrtc.so", python=str(dies)))


def test_a_hung_child_is_stopped_after_its_timeout(tmp_path: pathlib.Path) -> None:
    hangs = tmp_path / "hangs"
    hangs.write_text("#!/bin/sh\nsleep 30\n")
    hangs.chmod(0o755)
    with pytest.raises(nvrtc.NvrtcError, match="timed out"):
        _compile(nvrtc.IsolatedNvrtc("/lib/libnvrtc.so", python=str(hangs), timeout_s=0.5))


def test_the_child_imports_only_the_standard_library() -> None:
    """No kapitsa, no MLX: a child must not pay their imports, nor open the GPU, per kernel."""
    request = {"library": "/nonexistent/libnvrtc.so", "source": "", **REQUEST}
    done = subprocess.run(
        [sys.executable, "-I", "-X", "importtime", nvrtc.__file__],
        input=json.dumps(request).encode(),
        capture_output=True,
        timeout=60,
        check=False,
    )
    reply = json.loads(done.stdout)
    assert done.returncode == 1 and "/nonexistent/libnvrtc.so" in reply["error"]
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.decode().splitlines() if "|" in line]
    assert "ctypes" in imported
    assert not [m for m in imported if m.split(".")[0] in ("kapitsa", "mlx", "numpy")]


def test_children_run_only_from_an_interpreter_of_this_python(tmp_path: pathlib.Path, monkeypatch) -> None:
    """`sys.executable` names the host program of an embedded or frozen Python: a child started
    from it would not run this file, so compiles stay in the process there."""
    assert nvrtc.runs_children(sys.executable)
    other = tmp_path / "python-other"
    other.write_text("#!/bin/sh\necho 50859248\n")  # another Python's hexversion
    other.chmod(0o755)
    assert not nvrtc.runs_children(str(other))
    assert not nvrtc.runs_children("/bin/false") and not nvrtc.runs_children("/nonexistent/python3")
    monkeypatch.setattr(sys, "frozen", True, raising=False)
    assert not nvrtc.runs_children(sys.executable)
