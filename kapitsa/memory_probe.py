"""How much memory a model may plan on (the budget doctor's verdicts use), and how much is free now.

The budget holds still while the machine runs, so a verdict does not flip because a browser tab
opened: Metal's recommended working set, CUDA's device memory, or a fixed share of RAM on MLX's CPU
backend. What the OS could hand out this minute only feeds a warning in `kapitsa doctor`.
The parsers are pure and take the text of /proc/meminfo, cgroup files and `vm_stat`, so the tests
run them on recordings.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

CPU_BUDGET_SHARE = 0.75
"""The share of RAM a model may plan on without a GPU: what Metal's working set grants on mid-size
Macs, leaving the rest to the OS and the user's other programs."""

_CGROUP_LIMIT_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")
_VM_STAT_PAGE = re.compile(r"page size of (\d+) bytes")
_VM_STAT_FREEABLE = ("Pages free", "Pages inactive", "Pages purgeable", "Pages speculative")


@dataclass(slots=True, frozen=True)
class MemoryBudget:
    usable_bytes: int  # what verdicts and context lengths are computed from
    source: str  # where `usable_bytes` comes from, in words
    available_now_bytes: int | None  # what the OS can hand out now, reclaimable caches included


def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo as bytes per key (`MemTotal`, `MemAvailable`, ...)."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            values[key.strip()] = int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    return values


def parse_vm_stat(text: str) -> int | None:
    """Bytes macOS can hand out without swapping: free + inactive + purgeable + speculative pages.

    vm_stat prints speculative pages apart from free ones, and inactive pages (file cache first) are
    what macOS reclaims before it compresses or swaps. The page size comes from the header line
    (16 KiB on Apple silicon, 4 KiB on Intel). None when the text is not vm_stat's.
    """
    page = _VM_STAT_PAGE.search(text)
    if page is None:
        return None
    counts: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in _VM_STAT_FREEABLE and value.strip().rstrip(".").isdigit():
            counts[key.strip()] = int(value.strip().rstrip("."))
    if not counts:
        return None
    return sum(counts.values()) * int(page.group(1))


def parse_cgroup_limit(text: str | None, total_bytes: int) -> int | None:
    """A container's memory limit, or None when there is none ("max", or v1's huge "unlimited")."""
    value = (text or "").strip()
    if not value.isdigit():
        return None
    limit = int(value)
    return limit if 0 < limit < total_bytes else None


def memory_budget(
    backend: str,
    device: dict[str, object],
    total_bytes: int,
    *,
    meminfo: str | None = None,
    vm_stat: str | None = None,
    cgroup_limit: str | None = None,
) -> MemoryBudget:
    """The budget for verdicts and the memory free now, from what MLX and the OS report. Pure."""
    available_now = _available_now(backend, meminfo, vm_stat)
    if backend == "metal" and "max_recommended_working_set_size" in device:
        working_set = int(device["max_recommended_working_set_size"])  # type: ignore[call-overload]
        return MemoryBudget(working_set, "Metal recommended working set", available_now)
    if backend == "cuda" and "memory_size" in device:
        return MemoryBudget(int(device["memory_size"]), "CUDA device memory", None)  # type: ignore[call-overload]
    freeable = parse_vm_stat(vm_stat) if vm_stat else None
    if freeable is not None:  # macOS without Metal's figure: what the OS can free is the best we know
        return MemoryBudget(min(freeable, total_bytes), "memory macOS can free (vm_stat)", available_now)
    return _ram_share(total_bytes, meminfo, cgroup_limit, available_now)


def _ram_share(
    total_bytes: int, meminfo: str | None, cgroup_limit: str | None, available_now: int | None
) -> MemoryBudget:
    # A share of MemTotal, not MemAvailable: MemAvailable moves with every program the user starts,
    # and verdicts that change from one minute to the next are advice nobody can act on.
    ram = parse_meminfo(meminfo or "").get("MemTotal", total_bytes)
    limit = parse_cgroup_limit(cgroup_limit, ram)
    share = f"{round(CPU_BUDGET_SHARE * 100)}%"
    if limit is not None:
        return MemoryBudget(
            int(limit * CPU_BUDGET_SHARE), f"{share} of the container's memory limit", available_now
        )
    return MemoryBudget(int(ram * CPU_BUDGET_SHARE), f"{share} of RAM, CPU backend", available_now)


def _available_now(backend: str, meminfo: str | None, vm_stat: str | None) -> int | None:
    if backend == "cuda":  # weights live in device memory: free system RAM says nothing about them
        return None
    if vm_stat:
        return parse_vm_stat(vm_stat)
    return parse_meminfo(meminfo or "").get("MemAvailable")  # counts reclaimable page cache and slab


def probe_budget(backend: str, device: dict[str, object], total_bytes: int, *, system: str) -> MemoryBudget:
    """`memory_budget` on this machine's files and `vm_stat` output."""
    if system == "Darwin":
        return memory_budget(backend, device, total_bytes, vm_stat=_vm_stat_text())
    cgroup = next((text for path in _CGROUP_LIMIT_FILES if (text := _read_text(path))), None)
    return memory_budget(
        backend, device, total_bytes, meminfo=_read_text("/proc/meminfo"), cgroup_limit=cgroup
    )


def _read_text(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def _vm_stat_text() -> str | None:
    try:
        out = subprocess.run(["vm_stat"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None
