"""What the device has in use while something runs: NVML's count of the whole device, MLX's
arrays and buffer cache, CUDA's default memory pool and graph-memory pool (cudart, through ctypes);
each figure None where its library is absent (the CPU). `Sampler` reads them on a thread."""

from __future__ import annotations

import ctypes
import os
import threading
import time

import mlx.core as mx

GB = 1024**3
POOL_RESERVED_CURRENT = 5  # cudaMemPoolAttrReservedMemCurrent
POOL_USED_CURRENT = 7  # cudaMemPoolAttrUsedMemCurrent
GRAPH_RESERVED_CURRENT = 2  # cudaGraphMemAttrReservedMemCurrent


class _NvmlMemory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


class DeviceProbe:
    """The figures one sample reads; each is None where its library is absent (the CPU)."""

    def __init__(self) -> None:
        self.nvml, self.handle = _open_nvml()
        self.cudart = _loaded_cudart()
        self.pool = ctypes.c_void_p()
        if self.cudart is not None and self.cudart.cudaDeviceGetDefaultMemPool(ctypes.byref(self.pool), 0):
            self.cudart = None

    def sample(self) -> dict:
        row = dict(
            t=time.perf_counter(),
            active=mx.get_active_memory() / GB,
            cache=mx.get_cache_memory() / GB,
        )
        if self.nvml is not None:
            memory = _NvmlMemory()
            if self.nvml.nvmlDeviceGetMemoryInfo(self.handle, ctypes.byref(memory)) == 0:
                row["device_used"] = memory.used / GB
        if self.cudart is not None:
            row["pool_reserved"] = self._pool(POOL_RESERVED_CURRENT)
            row["pool_used"] = self._pool(POOL_USED_CURRENT)
            value = ctypes.c_uint64()
            if (
                self.cudart.cudaDeviceGetGraphMemAttribute(0, GRAPH_RESERVED_CURRENT, ctypes.byref(value))
                == 0
            ):
                row["graph_reserved"] = value.value / GB
        return row

    def _pool(self, attribute: int) -> float | None:
        value = ctypes.c_uint64()
        failed = self.cudart.cudaMemPoolGetAttribute(self.pool, attribute, ctypes.byref(value))
        return None if failed else value.value / GB


def _open_nvml():
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None, None
    handle = ctypes.c_void_p()
    if nvml.nvmlInit_v2() or nvml.nvmlDeviceGetHandleByIndex_v2(_physical_index(), ctypes.byref(handle)):
        return None, None
    return nvml, handle


def _physical_index() -> int:
    """NVML's index of MLX's device 0: NVML ignores CUDA_VISIBLE_DEVICES, MLX does not."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return int(first) if first.isdigit() else 0


def _loaded_cudart():
    """The CUDA runtime this process already loaded (MLX's), from /proc/self/maps."""
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    return ctypes.CDLL(sorted(paths)[0]) if paths else None


class Sampler(threading.Thread):
    """Samples the probe every `interval_s` until stopped; keeps every sample."""

    def __init__(self, probe: DeviceProbe, interval_s: float = 0.005) -> None:
        super().__init__(daemon=True)
        self.probe, self.interval_s = probe, interval_s
        self.samples: list[dict] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.samples.append(self.probe.sample())
            time.sleep(self.interval_s)

    def stop(self) -> list[dict]:
        self.done.set()
        self.join()
        return self.samples
