"""Machine facts that make bench numbers comparable: chip, cores, memory, OS, MLX build."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from importlib import metadata
from typing import Any


def machine_info() -> dict[str, Any]:
    """A JSON-ready description of this machine (no MLX import: read from package metadata)."""
    return {
        "os": f"{platform.system()} {platform.release()}",
        "arch": platform.machine(),
        "chip": _chip_name(),
        "cpu_count": os.cpu_count(),
        "memory_bytes": _total_memory_bytes(),
        "python": platform.python_version(),
        "mlx": _version("mlx"),
        "mlx_backend": _mlx_backend(),
    }


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _mlx_backend() -> str | None:
    for package, backend in (("mlx-metal", "metal"), ("mlx-cuda", "cuda"), ("mlx-cpu", "cpu")):
        if _version(package):
            return backend
    return "metal" if sys.platform == "darwin" and _version("mlx") else None


def _chip_name() -> str | None:
    if sys.platform == "darwin":
        try:
            out = subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, timeout=5
            )
            return out.stdout.strip() or None
        except OSError:
            return None
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _total_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
