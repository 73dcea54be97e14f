"""Backend kernels, each beside a plain MLX-ops reference it is tested against.

`backend()` says which custom-kernel path this process can use ("cuda", "metal" or None); every
public op falls back to its reference when there is no kernel for the backend, never fails.
"""

from __future__ import annotations

import functools
import struct

import mlx.core as mx

from kapitsa.engine.options import KernelOptions


@functools.cache
def backend() -> str | None:
    if mx.default_device().type != mx.DeviceType.gpu:
        return None
    if mx.cuda.is_available():
        return "cuda"
    if mx.metal.is_available():
        return "metal"
    return None


def float_bits(value: float) -> int:
    """A float32's bit pattern as a signed int: kernels take floats as integer template arguments
    and reinterpret them (`__int_as_float`, `as_type<float>`)."""
    return struct.unpack("<i", struct.pack("<f", value))[0]


# Families the models use unless told otherwise: those verified and timed in the models on the H200
# (lab/runs/decode-h200.md). The Mamba-2 kernel takes a Mamba layer's decode step from ~64
# primitives to ~11 (lab/graph_census.py), at ~3-5 us of host time per primitive there: in one
# process (session 6) Nemotron-3-Nano decoded at 200 tok/s with it and 110 without. No Metal kernel has
# been compiled or run on Apple hardware yet, so on Metal every family is opt-in: the models run
# the fused + compiled op path there. Off-GPU (no backend) the kernels fall back to their
# references anyway; the CUDA set keeps the CPU tests on the same call path as CUDA.
# "qmv" is the quantized mat-vec routes of kapitsa/engine/ops/linear.py (CUDA only); "route" the fused
# MoE router (kernels/router.py): in session 7's in-process A/B it made the 35B-A3B decode 30% and
# 22% faster in each of two rounds (with "attn" also on; Nemotron's rounds were mixed on a noisy
# host). "attn" is the attention layer's decode kernels: the prep of q, k, v after the fused
# projection (kernels/attn_prep.py; the layer's decode step from ~45 primitives to 11 by
# lab/graph_census.py, where a linear-attention layer takes 7) and the decode attention for head
# sizes MLX's CUDA backend lacks (kernels/attention.py; alone it was within noise on the 27B in
# session 7). A default from session 8, A/B'd in that session's H200 run (lab/runs/decode-h200.md).
DEFAULT_FAMILIES = {
    "cuda": frozenset({"gdn", "moe", "qmv", "mamba", "route", "attn"}),
    "metal": frozenset(),
    None: frozenset({"gdn", "moe", "qmv", "mamba", "route", "attn"}),
}


def probe_enabled(options: KernelOptions) -> None:
    """Run the one-time probe of each enabled family that has one ("route", "attn"); each
    kernel is used only after its probe passed. They evaluate: call this outside any trace."""
    from kapitsa.engine.kernels import attention, router  # they import this module

    if enabled("route", options):
        router.probe()
    if enabled("attn", options):
        attention.probe()  # (the attention prep is probed per layout by the layers themselves)


def enabled(name: str, options: KernelOptions) -> bool:
    """Whether the model may use kernel family `name` (options.KERNEL_FAMILIES): the families
    `options` names, or this backend's DEFAULT_FAMILIES when it names none."""
    families = DEFAULT_FAMILIES[backend()] if options.families is None else options.families
    return name in families
