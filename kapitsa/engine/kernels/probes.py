"""The one-time probes of the kernel families that have one, run once per engine before any trace."""

from __future__ import annotations

from kapitsa.engine.kernels import attention, enabled, router
from kapitsa.engine.options import KernelOptions


def probe_enabled(options: KernelOptions) -> None:
    """Run the one-time probe of each enabled family that has one ("route", "attn"); each
    kernel is used only after its probe passed. They evaluate: call this outside any trace."""
    if enabled("route", options):
        router.probe()
    if enabled("attn", options):
        attention.probe()  # (the attention prep is probed per layout by the layers themselves)
