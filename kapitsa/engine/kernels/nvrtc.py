"""NVRTC through ctypes: compile one CUDA translation unit to a cubin (or PTX) with the kernels'
lowered names, as MLX's JIT does (mlx/backend/cuda/jit_module.cpp, `compile`).

The library is the one this process already loaded for MLX (read from /proc/self/maps), so the
compiler and its headers match MLX's; `Nvrtc(path)` names another one. The GPU's compute capability
comes from the CUDA driver (libcuda, which MLX has loaded too).
"""

from __future__ import annotations

import ctypes
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass

_SUCCESS = 0
_CC_MAJOR, _CC_MINOR = 75, 76  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_{MAJOR,MINOR}


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
