"""NVRTC through ctypes: compile one CUDA translation unit to a cubin (or PTX) with the kernels'
lowered names, as MLX's JIT does (mlx/backend/cuda/jit_module.cpp, `compile`).

The library is the one this process already loaded for MLX (read from /proc/self/maps), so the
compiler and its headers match MLX's; `Nvrtc(path)` names another one. The GPU's compute capability
comes from the CUDA driver (libcuda, which MLX has loaded too).

`IsolatedNvrtc` runs each compile in a child process of its own (this file, run as a script with
the standard library only). One process's NVRTC compiles programs that include headers one after
another, whatever the threads calling it: eight of kapitsa's kernels wrapped as MLX wraps them
took 8.6-9.4 s on two threads against 9.7-9.8 s on one, and 6.6-6.9 s in two child processes
(NVRTC 13.5, a 2-core CPU; lab/nvrtc_parallel.py). So children are what let a start's compiles
run side by side, and a compiler that crashes takes only its child down.
"""

from __future__ import annotations

import base64
import ctypes
import json
import pathlib
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

_SUCCESS = 0
_CC_MAJOR, _CC_MINOR = 75, 76  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_{MAJOR,MINOR}
# One compile in a child takes 1-15 s on an H100's host; past this the child is taken for hung
CHILD_TIMEOUT_S = 300.0


class NvrtcError(RuntimeError):
    """A call into NVRTC failed; the message carries the compile log when there is one."""


@dataclass(frozen=True)
class Compiled:
    binary: bytes  # a cubin for `sm_XY` targets, PTX text for `compute_XY`
    lowered_names: dict[str, str]  # name expression -> mangled symbol in `binary`


def loaded_library(stem: str) -> str | None:
    """The path of the shared library `stem` (e.g. "libnvrtc.so") this process has mapped."""
    try:
        maps = pathlib.Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and pathlib.PurePath(fields[5]).name.startswith(stem):
            return fields[5]
    return None


class Nvrtc:
    def __init__(self, path: str) -> None:
        self.path = path
        self._lib = ctypes.CDLL(path)
        self._lib.nvrtcGetErrorString.restype = ctypes.c_char_p

    def version(self) -> tuple[int, int]:
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self._lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        return major.value, minor.value

    def supported_archs(self) -> tuple[int, ...]:
        """The `sm_XY` targets this NVRTC can emit SASS for, as XY."""
        count = ctypes.c_int()
        self._check(self._lib.nvrtcGetNumSupportedArchs(ctypes.byref(count)), "nvrtcGetNumSupportedArchs")
        archs = (ctypes.c_int * count.value)()
        self._check(self._lib.nvrtcGetSupportedArchs(archs), "nvrtcGetSupportedArchs")
        return tuple(archs)

    def compile(
        self,
        source: str,
        *,
        filename: str,
        name_expressions: Sequence[str],
        options: Sequence[str],
        headers: dict[str, str] | None = None,
    ) -> Compiled:
        """Compile `source`; `headers` maps an include name to text NVRTC sees in place of a file."""
        headers = headers or {}
        program = ctypes.c_void_p()
        self._check(
            self._lib.nvrtcCreateProgram(
                ctypes.byref(program),
                source.encode(),
                filename.encode(),
                len(headers),
                _strings(headers.values()),
                _strings(headers.keys()),
            ),
            "nvrtcCreateProgram",
        )
        try:
            for name in name_expressions:
                self._check(
                    self._lib.nvrtcAddNameExpression(program, name.encode()), "nvrtcAddNameExpression"
                )
            result = self._lib.nvrtcCompileProgram(program, len(options), _strings(options))
            if result != _SUCCESS:
                raise NvrtcError(f"{self._error(result)}: {self._log(program)}")
            sass = any(o.startswith("--gpu-architecture=sm_") for o in options)
            return Compiled(self._binary(program, sass), self._lowered(program, name_expressions))
        finally:
            self._lib.nvrtcDestroyProgram(ctypes.byref(program))

    def _lowered(self, program: ctypes.c_void_p, names: Sequence[str]) -> dict[str, str]:
        lowered = {}
        for name in names:
            mangled = ctypes.c_char_p()
            self._check(
                self._lib.nvrtcGetLoweredName(program, name.encode(), ctypes.byref(mangled)),
                "nvrtcGetLoweredName",
            )
            lowered[name] = mangled.value.decode()
        return lowered

    def _binary(self, program: ctypes.c_void_p, sass: bool) -> bytes:
        kind = "CUBIN" if sass else "PTX"
        size = ctypes.c_size_t()
        self._check(
            getattr(self._lib, f"nvrtcGet{kind}Size")(program, ctypes.byref(size)), f"nvrtcGet{kind}Size"
        )
        buffer = ctypes.create_string_buffer(size.value)
        self._check(getattr(self._lib, f"nvrtcGet{kind}")(program, buffer), f"nvrtcGet{kind}")
        return buffer.raw

    def _log(self, program: ctypes.c_void_p) -> str:
        size = ctypes.c_size_t()
        if self._lib.nvrtcGetProgramLogSize(program, ctypes.byref(size)) != _SUCCESS:
            return ""
        buffer = ctypes.create_string_buffer(size.value + 1)
        self._lib.nvrtcGetProgramLog(program, buffer)
        return buffer.value.decode(errors="replace")

    def _error(self, result: int) -> str:
        return self._lib.nvrtcGetErrorString(result).decode()

    def _check(self, result: int, call: str) -> None:
        if result != _SUCCESS:
            raise NvrtcError(f"{call}: {self._error(result)}")


class IsolatedNvrtc:
    """`Nvrtc(path).compile` in a child process per call (see the module's docstring): `python` runs
    this file with `-I -S`, so the child imports neither kapitsa, MLX nor site-packages and touches
    no GPU. The request goes in on stdin and the cubin comes back on stdout, as JSON."""

    def __init__(
        self, path: str, *, python: str = sys.executable, timeout_s: float = CHILD_TIMEOUT_S
    ) -> None:
        self.path, self.python, self.timeout_s = path, python, timeout_s

    def compile(
        self,
        source: str,
        *,
        filename: str,
        name_expressions: Sequence[str],
        options: Sequence[str],
        headers: dict[str, str] | None = None,
    ) -> Compiled:
        request = {
            "library": self.path,
            "source": source,
            "filename": filename,
            "name_expressions": list(name_expressions),
            "options": list(options),
            "headers": dict(headers or {}),
        }
        try:
            done = subprocess.run(
                [self.python, "-I", "-S", __file__],
                input=json.dumps(request).encode(),
                capture_output=True,
                timeout=self.timeout_s,
                check=False,
            )
        except (OSError, subprocess.SubprocessError) as err:  # no interpreter to start, or a hung compile
            raise NvrtcError(f"NVRTC's child process: {err}") from err
        reply = _json_object(done.stdout)
        if done.returncode == 0 and "binary" in reply:
            return Compiled(base64.b64decode(reply["binary"]), dict(reply["lowered_names"]))
        stderr = done.stderr.decode(errors="replace").strip()[-2000:]
        raise NvrtcError(
            reply.get("error") or f"NVRTC's child process exited with status {done.returncode}: {stderr}"
        )


def _json_object(data: bytes) -> dict:
    try:
        value = json.loads(data)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _compile_request(request: dict) -> dict:
    """A child's work: the request's program compiled, or the error that stopped it, as JSON-ready."""
    try:
        compiled = Nvrtc(request["library"]).compile(
            request["source"],
            filename=request["filename"],
            name_expressions=request["name_expressions"],
            options=request["options"],
            headers=request["headers"],
        )
    except (NvrtcError, OSError, AttributeError) as err:  # AttributeError: a library without NVRTC's API
        return {"error": str(err)}
    return {"binary": base64.b64encode(compiled.binary).decode(), "lowered_names": compiled.lowered_names}


def compute_capability(device: int = 0) -> tuple[int, int]:
    """(major, minor) of CUDA device `device`, from the driver MLX loaded."""
    driver = ctypes.CDLL(loaded_library("libcuda.so") or "libcuda.so.1")
    handle, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    _driver_ok(driver.cuInit(0), "cuInit")
    _driver_ok(driver.cuDeviceGet(ctypes.byref(handle), device), "cuDeviceGet")
    _driver_ok(driver.cuDeviceGetAttribute(ctypes.byref(major), _CC_MAJOR, handle), "cuDeviceGetAttribute")
    _driver_ok(driver.cuDeviceGetAttribute(ctypes.byref(minor), _CC_MINOR, handle), "cuDeviceGetAttribute")
    return major.value, minor.value


def _driver_ok(result: int, call: str) -> None:
    if result != _SUCCESS:
        raise NvrtcError(f"{call} failed with CUDA error {result}")


def _strings(values) -> ctypes.Array:
    encoded = [v.encode() for v in values]
    return (ctypes.c_char_p * max(1, len(encoded)))(*encoded)


def runs_children(python: str) -> bool:
    """Whether `python` can run this file as `IsolatedNvrtc`'s child: a file on disk (not inside a
    zip or a frozen app) and an interpreter of this Python's version (not the host program of an
    embedded one, which `sys.executable` names there)."""
    if getattr(sys, "frozen", False) or not pathlib.Path(__file__).is_file():
        return False
    try:
        done = subprocess.run(
            [python, "-I", "-S", "-c", "import sys; print(sys.hexversion)"],
            capture_output=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0 and done.stdout.strip() == str(sys.hexversion).encode()


if __name__ == "__main__":  # IsolatedNvrtc's child
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a Ctrl-C to the server ends a compile quietly
    reply = _compile_request(json.load(sys.stdin))
    json.dump(reply, sys.stdout)
    sys.exit(1 if "error" in reply else 0)
