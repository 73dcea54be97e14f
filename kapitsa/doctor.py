"""`kapitsa doctor`: what this machine has, and which catalog models fit in it with how much context.

`probe_hardware()` reads the machine (its memory budget comes from `kapitsa.memory_probe`);
`build_report(hardware, catalog)` is pure, so the TUI and the tests can run it on recorded profiles
(`RECORDED_PROFILES`). `kapitsa.doctor_render` turns a report into text or rich tables.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from kapitsa import memory_estimate, memory_probe
from kapitsa.catalog import (
    Catalog,
    CatalogEntry,
    Quant,
    arch_for_folder,
    package_model_path,
    weight_bytes_on_disk,
)
from kapitsa.engine.loading.small_rule import SMALL, choose_rest_bits, small_weights_bytes
from kapitsa.errors import KapitsaError
from kapitsa.units import format_bytes

GiB = 1 << 30
MIN_MACOS = (14, 0)
Backend = Literal["metal", "cuda", "cpu", "none"]


@dataclass(slots=True, frozen=True)
class HardwareProfile:
    os_name: str  # "macOS 15.3", "Linux 6.8.0"
    machine: str  # "arm64", "x86_64"
    chip: str  # "Apple M4 Pro", "AMD EPYC"
    is_apple_silicon: bool
    total_memory_bytes: int
    usable_memory_bytes: int  # the budget verdicts use: Metal's recommended working set on a Mac
    usable_memory_source: str
    backend: Backend
    gpu: str
    mlx_version: str | None
    disk_free_bytes: int
    disk_path: str
    macos_version: tuple[int, ...] | None = None
    available_now_bytes: int | None = None  # free this minute (reclaimable caches included): warnings only


@dataclass(slots=True, frozen=True)
class ModelFit:
    ref: str  # "27b" or "27b:6bit": what to pass to --model
    alias: str
    name: str
    quant: str | None
    repo_id: str | None
    weights_bytes: int | None
    max_context: int | None
    verdict: Literal["fits", "tight", "too_big", "unavailable"]
    estimated: bool = False  # architecture numbers not from a primary config
    note: str = ""
    takes_images: bool = False  # a vision-language model: prompts may hold images


@dataclass(slots=True, frozen=True)
class DoctorReport:
    hardware: HardwareProfile
    models: tuple[ModelFit, ...]
    recommended: str | None
    warnings: tuple[str, ...] = field(default_factory=tuple)
    # `:small` refs of MoE models whose default quant does not fit here but the recipe does
    also_small: tuple[str, ...] = field(default_factory=tuple)

    def to_json_dict(self) -> dict[str, object]:
        return asdict(self)


def _profile(name: str, chip: str, total_gib: int, usable_bytes: int, macos: str) -> HardwareProfile:
    return HardwareProfile(
        os_name=f"macOS {macos}",
        machine="arm64",
        chip=chip,
        is_apple_silicon=True,
        total_memory_bytes=total_gib * GiB,
        usable_memory_bytes=usable_bytes,
        usable_memory_source="Metal recommended working set (recorded)",
        backend="metal",
        gpu=f"{chip} GPU",
        mlx_version="0.32.4",
        disk_free_bytes=500 * 10**9,
        disk_path="~",
        macos_version=tuple(int(p) for p in macos.split(".")),
    )


# recommendedMaxWorkingSetSize as reported by Metal: 2/3 of RAM on a 16 GB Mac (10922.67 MB in
# llama.cpp logs), 3/4 on mid-size ones, 107.52 GiB measured on a 128 GB M5 Max (antirez/ds4#893).
RECORDED_PROFILES: dict[str, HardwareProfile] = {
    "m1-pro-16gb": _profile("m1-pro-16gb", "Apple M1 Pro", 16, int(10922.67 * 2**20), "14.6"),
    "m4-pro-48gb": _profile("m4-pro-48gb", "Apple M4 Pro", 48, 36 * GiB, "15.3"),
    "m5-max-128gb": _profile("m5-max-128gb", "Apple M5 Max", 128, int(107.52 * GiB), "26.1"),
}


def probe_hardware(disk_path: Path | None = None) -> HardwareProfile:
    """Read this machine. Never raises for a missing MLX or an unknown platform: it reports them."""
    system, machine = platform.system(), platform.machine()
    macos = tuple(int(p) for p in platform.mac_ver()[0].split(".") if p) if system == "Darwin" else None
    total = _total_memory_bytes()
    mlx_version, backend, device = _mlx_info()
    budget = memory_probe.probe_budget(backend, device, total, system=system)
    path = disk_path or _hf_cache_dir()
    return HardwareProfile(
        os_name=f"macOS {'.'.join(map(str, macos or ()))}"
        if system == "Darwin"
        else f"{system} {platform.release()}",
        machine=machine,
        chip=_chip_name(system, device),
        is_apple_silicon=system == "Darwin" and machine == "arm64",
        total_memory_bytes=total,
        usable_memory_bytes=budget.usable_bytes,
        usable_memory_source=budget.source,
        backend=backend,
        gpu=_gpu_name(backend, device),
        mlx_version=mlx_version,
        disk_free_bytes=_disk_free(path),
        disk_path=str(path),
        macos_version=macos,
        available_now_bytes=budget.available_now_bytes,
    )


def _mlx_info() -> tuple[str | None, Backend, dict[str, object]]:
    try:
        import mlx.core as mx
    except ImportError:
        return None, "none", {}
    backend: Backend = "cpu"
    if mx.metal.is_available():
        backend = "metal"
    elif hasattr(mx, "cuda") and mx.cuda.is_available():
        backend = "cuda"
    device: dict[str, object] = {}
    for read in (lambda: mx.device_info(), lambda: mx.metal.device_info()):  # newer MLX, then older
        try:
            device = dict(read())
            break
        except (RuntimeError, AttributeError):
            continue
    return mx.__version__, backend, device


def _total_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _chip_name(system: str, device: dict[str, object]) -> str:
    if system == "Darwin":
        try:
            out = subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, timeout=5
            )
            if out.stdout.strip():
                return out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return str(device.get("device_name") or platform.processor() or "unknown")


def _gpu_name(backend: Backend, device: dict[str, object]) -> str:
    if backend in ("metal", "cuda"):
        return str(device.get("device_name", backend))
    return "none usable by MLX (CPU backend)"


def _hf_cache_dir() -> Path:
    from huggingface_hub import constants

    path = Path(constants.HF_HUB_CACHE)
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _disk_free(path: Path) -> int:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0


def build_report(hardware: HardwareProfile, catalog: Catalog, *, num_checkpoints: int = 4) -> DoctorReport:
    """Per model and quant: fits or not, and the longest context that fits. Pure: no I/O but the demo's folder."""
    fits = tuple(fit for entry in catalog for fit in _entry_fits(entry, hardware, num_checkpoints))
    recommended = _recommend(catalog, fits, backend=hardware.backend)
    return DoctorReport(
        hardware=hardware,
        models=fits,
        recommended=recommended,
        warnings=tuple(_warnings(hardware, fits, recommended)),
        also_small=_also_small(catalog, fits, backend=hardware.backend),
    )


def _entry_fits(entry: CatalogEntry, hw: HardwareProfile, num_checkpoints: int) -> list[ModelFit]:
    if entry.package_path is not None:
        return [_package_fit(entry, hw, num_checkpoints)]
    fits = [_quant_fit(entry, quant, hw, num_checkpoints) for quant in entry.quants]
    if entry.arch is not None and entry.arch.is_moe:
        fits.append(_small_fit(entry, hw, num_checkpoints))
    return fits


def _small_fit(entry: CatalogEntry, hw: HardwareProfile, num_checkpoints: int) -> ModelFit:
    """`alias:small`: routed experts at 2 bits, the rest at the width this budget gets (small_rule)."""
    assert entry.arch is not None
    experts = entry.arch.expert_params_b * 1e9
    rest = max(entry.arch.params_b * 1e9 - experts, 0.0)
    bits = choose_rest_bits(hw.usable_memory_bytes, expert_params=experts, rest_params=rest)
    weights = small_weights_bytes(expert_params=experts, rest_params=rest, rest_bits=bits)
    est = memory_estimate.estimate(
        entry.arch,
        usable_bytes=hw.usable_memory_bytes,
        weight_bytes=weights,
        num_checkpoints=num_checkpoints,
        backend=memory_estimate.gpu_backend(hw.backend),
    )
    return ModelFit(
        ref=f"{entry.alias}:{SMALL}",
        alias=entry.alias,
        name=entry.name,
        quant=SMALL,
        repo_id=entry.quant(entry.small_source).repo_id,
        weights_bytes=weights,
        max_context=est.max_context,
        verdict=est.verdict,
        estimated=entry.estimated,
        note=f"routed experts 2-bit, the rest {bits}-bit",
        takes_images=entry.arch.takes_images,
    )


def _quant_fit(entry: CatalogEntry, quant: Quant, hw: HardwareProfile, num_checkpoints: int) -> ModelFit:
    assert entry.arch is not None
    weights = memory_estimate.weights_bytes(entry.arch, quant.bits_per_weight)
    est = memory_estimate.estimate(
        entry.arch,
        usable_bytes=hw.usable_memory_bytes,
        weight_bytes=weights,
        num_checkpoints=num_checkpoints,
        backend=memory_estimate.gpu_backend(hw.backend),
    )
    ref = entry.alias if quant.name == entry.default_quant else f"{entry.alias}:{quant.name}"
    return ModelFit(
        ref=ref,
        alias=entry.alias,
        name=entry.name,
        quant=quant.name,
        repo_id=quant.repo_id,
        weights_bytes=weights,
        max_context=est.max_context,
        verdict=est.verdict,
        estimated=entry.estimated,
        takes_images=entry.arch.takes_images,
    )


def _package_fit(entry: CatalogEntry, hw: HardwareProfile, num_checkpoints: int) -> ModelFit:
    try:
        folder = package_model_path(entry)
        arch = arch_for_folder(folder)
    except KapitsaError as err:
        return ModelFit(
            ref=entry.alias,
            alias=entry.alias,
            name=entry.name,
            quant=None,
            repo_id=None,
            weights_bytes=None,
            max_context=None,
            verdict="unavailable",
            note=str(err),
        )
    weights = weight_bytes_on_disk(folder)
    est = memory_estimate.estimate(
        arch,
        usable_bytes=hw.usable_memory_bytes,
        weight_bytes=weights,
        num_checkpoints=num_checkpoints,
        backend=memory_estimate.gpu_backend(hw.backend),
    )
    return ModelFit(
        ref=entry.alias,
        alias=entry.alias,
        name=entry.name,
        quant=None,
        repo_id=None,
        weights_bytes=weights,
        max_context=est.max_context,
        verdict=est.verdict,
        note=f"in {folder}",
        takes_images=arch.takes_images,
    )


CPU_MAX_WEIGHTS_BYTES = 5 * 10**9
"""Largest weights recommended without a GPU: CPU decode reads every weight per token from RAM, so a 27B
model (~15 GB at 4-bit) decodes at well under a token a second there; a 4B model stays usable."""


def _recommend(catalog: Catalog, fits: tuple[ModelFit, ...], *, backend: str = "metal") -> str | None:
    """The most capable model whose default quant fits comfortably; else the most capable that fits at all.

    Without a GPU (MLX's CPU device) only models up to CPU_MAX_WEIGHTS_BYTES are recommended.
    """
    ranks = {entry.alias: entry.rank for entry in catalog}
    if backend in ("cpu", "none"):
        fits = tuple(f for f in fits if (f.weights_bytes or 0) <= CPU_MAX_WEIGHTS_BYTES)
    for wanted in ("fits", "tight"):
        candidates = [f for f in fits if f.verdict == wanted and f.ref == f.alias]
        if candidates:
            return max(candidates, key=lambda f: (ranks[f.alias], f.max_context or 0)).ref
    return None


def _also_small(catalog: Catalog, fits: tuple[ModelFit, ...], *, backend: str) -> tuple[str, ...]:
    """MoE models that fit only with `:small` (their default quant does not), most capable first."""
    if backend in ("cpu", "none"):
        return ()
    ranks = {entry.alias: entry.rank for entry in catalog}
    too_big = {f.alias for f in fits if f.ref == f.alias and f.verdict == "too_big"}
    small = [f for f in fits if f.quant == SMALL and f.alias in too_big and f.verdict in ("fits", "tight")]
    return tuple(f.ref for f in sorted(small, key=lambda f: -ranks[f.alias]))


def _warnings(hw: HardwareProfile, fits: tuple[ModelFit, ...], recommended: str | None) -> list[str]:
    warnings = _platform_warnings(hw)
    if not any(f.verdict in ("fits", "tight") and f.alias != "demo" for f in fits):
        warnings.append("no catalog model fits in this machine's usable memory; only the demo will run")
    downloadable = [f.weights_bytes for f in fits if f.verdict == "fits" and f.weights_bytes and f.repo_id]
    smallest_fitting = min(downloadable, default=None)  # the packaged demo needs no download
    if smallest_fitting is not None and hw.disk_free_bytes < smallest_fitting:
        warnings.append(
            f"only {format_bytes(hw.disk_free_bytes)} free at {hw.disk_path}: not enough for any model that fits"
        )
    free_now = _free_now_warning(hw, next((f for f in fits if f.ref == recommended), None))
    return [*warnings, free_now] if free_now else warnings


def _platform_warnings(hw: HardwareProfile) -> list[str]:
    warnings: list[str] = []
    if hw.macos_version is None:
        warnings.append(
            f"not macOS ({hw.os_name}): MLX runs on the {hw.backend.upper()} backend here; "
            "fine for development and CI, far slower than an Apple GPU"
        )
    elif not hw.is_apple_silicon:
        warnings.append("not Apple silicon: MLX needs an M-series Mac for Metal")
    elif hw.macos_version < MIN_MACOS:
        warnings.append(f"{hw.os_name} is older than macOS 14 (Sonoma), the oldest MLX supports")
    if hw.mlx_version is None:
        warnings.append("MLX is not installed: nothing can run")
    return warnings


def _free_now_warning(hw: HardwareProfile, recommended: ModelFit | None) -> str | None:
    """Memory taken this minute changes no verdict; it only warns when the recommended model cannot load now."""
    if hw.available_now_bytes is None or recommended is None or not recommended.weights_bytes:
        return None
    needed = recommended.weights_bytes + memory_estimate.HEADROOM_BYTES
    if hw.available_now_bytes >= needed:
        return None
    return (
        f"only {format_bytes(hw.available_now_bytes)} free now; close apps before starting "
        f"{recommended.ref} (it needs about {format_bytes(needed)}) or it will swap"
    )
