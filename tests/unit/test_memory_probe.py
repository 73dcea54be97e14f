"""The memory budget doctor's verdicts use holds still; memory free this minute only warns."""

from __future__ import annotations

from dataclasses import replace

from kapitsa.catalog import load_catalog
from kapitsa.doctor import RECORDED_PROFILES, build_report
from kapitsa.memory_probe import (
    CPU_BUDGET_SHARE,
    memory_budget,
    parse_cgroup_limit,
    parse_meminfo,
    parse_vm_stat,
)

GiB = 1 << 30

# `vm_stat` as macOS 14 prints it on a 16 GB Apple silicon Mac (16 KiB pages).
VM_STAT_APPLE = """\
Mach Virtual Memory Statistics: (page size of 16384 bytes)
Pages free:                               20000.
Pages active:                            400000.
Pages inactive:                          380000.
Pages speculative:                        15000.
Pages throttled:                              0.
Pages wired down:                        200000.
Pages purgeable:                          12000.
"Translation faults":                 912345678.
Pages copy-on-write:                   12345678.
Pages zero filled:                    345678901.
Pages reactivated:                      2345678.
Pages purged:                            456789.
File-backed pages:                       300000.
Anonymous pages:                         495000.
Pages stored in compressor:              150000.
Pages occupied by compressor:             30000.
Decompressions:                         3456789.
Compressions:                           4567890.
Pageins:                                5678901.
Pageouts:                                 67890.
Swapins:                                      0.
Swapouts:                                     0.
"""

# The same on an Intel Mac (4 KiB pages), trimmed to the lines that count.
VM_STAT_INTEL = """\
Mach Virtual Memory Statistics: (page size of 4096 bytes)
Pages free:                              100000.
Pages active:                            900000.
Pages inactive:                          700000.
Pages speculative:                        50000.
Pages wired down:                        300000.
Pages purgeable:                          25000.
"""


def _meminfo(available_kb: int, total_kb: int = 65_855_240) -> str:
    """/proc/meminfo of a 64 GB Linux box, with `available_kb` free now."""
    return (
        f"MemTotal:       {total_kb} kB\n"
        f"MemFree:        {available_kb // 2} kB\n"
        f"MemAvailable:   {available_kb} kB\n"
        "Buffers:          412340 kB\n"
        "Cached:         9876540 kB\n"
        "SwapTotal:      8388604 kB\n"
        "HugePages_Total:       0\n"
        "Hugepagesize:       2048 kB\n"
    )


IDLE_MEMINFO = _meminfo(available_kb=58_000_000)
BUSY_MEMINFO = _meminfo(available_kb=2_000_000)  # a build and a browser took most of it


def test_vm_stat_counts_free_inactive_purgeable_and_speculative_pages() -> None:
    assert parse_vm_stat(VM_STAT_APPLE) == (20000 + 380000 + 12000 + 15000) * 16384
    assert (
        parse_vm_stat(VM_STAT_INTEL) == (100000 + 700000 + 25000 + 50000) * 4096
    )  # page size from the header


def test_text_that_is_not_vm_stat_gives_nothing() -> None:
    assert parse_vm_stat("") is None
    assert parse_vm_stat("vm_stat: command not found") is None


def test_meminfo_in_bytes() -> None:
    values = parse_meminfo(IDLE_MEMINFO)
    assert values["MemTotal"] == 65_855_240 * 1024
    assert values["MemAvailable"] == 58_000_000 * 1024
    assert values["HugePages_Total"] == 0  # a count, not kB


def test_cpu_verdicts_hold_still_when_programs_take_memory() -> None:
    total = 65_855_240 * 1024
    idle = memory_budget("cpu", {}, total, meminfo=IDLE_MEMINFO, cgroup_limit="max")
    busy = memory_budget("cpu", {}, total, meminfo=BUSY_MEMINFO, cgroup_limit="max")
    assert idle.usable_bytes == busy.usable_bytes == int(total * CPU_BUDGET_SHARE)
    assert (idle.available_now_bytes, busy.available_now_bytes) == (58_000_000 * 1024, 2_000_000 * 1024)
    linux = replace(RECORDED_PROFILES["m5-max-128gb"], backend="cpu", macos_version=None, os_name="Linux")
    reports = [
        build_report(
            replace(linux, usable_memory_bytes=b.usable_bytes, available_now_bytes=b.available_now_bytes),
            load_catalog(),
        )
        for b in (idle, busy)
    ]
    assert [(f.ref, f.verdict, f.max_context) for f in reports[0].models] == [
        (f.ref, f.verdict, f.max_context) for f in reports[1].models
    ]
    assert reports[0].recommended == reports[1].recommended
    assert not any("free now" in w for w in reports[0].warnings)
    (free_now,) = [w for w in reports[1].warnings if "free now" in w]
    assert free_now.startswith("only 2.0 GB free now; close apps") and reports[1].recommended in free_now


def test_a_container_limit_caps_the_budget() -> None:
    total = 65_855_240 * 1024
    limited = memory_budget("cpu", {}, total, meminfo=IDLE_MEMINFO, cgroup_limit=f"{16 * GiB}\n")
    assert limited.usable_bytes == int(16 * GiB * CPU_BUDGET_SHARE)
    assert "container" in limited.source
    assert parse_cgroup_limit("max\n", total) is None
    assert (
        parse_cgroup_limit(str(2**63 - 4096), total) is None
    )  # cgroup v1 writes "unlimited" as a huge number


def test_metal_plans_on_the_working_set_and_vm_stat_only_says_what_is_free_now() -> None:
    device = {"max_recommended_working_set_size": int(10922.67 * 2**20)}
    budget = memory_budget("metal", device, 16 * GiB, vm_stat=VM_STAT_APPLE)
    assert budget.usable_bytes == device["max_recommended_working_set_size"]
    assert budget.available_now_bytes == parse_vm_stat(VM_STAT_APPLE)


def test_macos_without_metal_info_plans_on_what_macos_can_free() -> None:
    budget = memory_budget("none", {}, 16 * GiB, vm_stat=VM_STAT_APPLE)
    assert budget.usable_bytes == parse_vm_stat(VM_STAT_APPLE)
    assert "vm_stat" in budget.source


def test_cuda_memory_free_now_is_not_system_ram() -> None:
    budget = memory_budget("cuda", {"memory_size": 80 * GiB}, 512 * GiB, meminfo=BUSY_MEMINFO)
    assert (budget.usable_bytes, budget.available_now_bytes) == (80 * GiB, None)


def test_memory_taken_now_warns_on_a_mac_without_changing_a_verdict() -> None:
    mac = RECORDED_PROFILES["m4-pro-48gb"]
    calm = build_report(mac, load_catalog())
    crowded = build_report(replace(mac, available_now_bytes=5 * 10**9), load_catalog())
    assert [(f.verdict, f.max_context) for f in calm.models] == [
        (f.verdict, f.max_context) for f in crowded.models
    ]
    assert [w for w in crowded.warnings if w not in calm.warnings] == [
        next(w for w in crowded.warnings if w.startswith("only 5.0 GB free now; close apps before starting"))
    ]
