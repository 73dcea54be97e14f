"""Backend kernels, each beside a plain MLX-ops reference it is tested against.

This package's `__init__` imports none of its modules (they import it for `backend`): the
one-time probes that need several of them are in probes.py.

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
# (docs/results.md). The Mamba-2 kernel takes a Mamba layer's decode step from ~64 primitives to
# ~11 (lab/graph_census.py), at ~3-5 us of host time per primitive there: Nemotron decodes at
# 200 tok/s with it and 110 without. "qmv" is the quantized mat-vec routes of
# kapitsa/engine/ops/linear.py (CUDA only); "route" the fused MoE router (kernels/router.py);
# "attn" the attention layer's decode kernels: the prep of q, k, v after the fused projection
# (kernels/attn_prep.py; the layer's decode step from ~45 primitives to 11) and the decode
# attention for head sizes MLX's CUDA backend lacks (kernels/attention.py). No Metal kernel has
# been compiled or run on Apple hardware, so on Metal every family is opt-in: the models run the
# fused + compiled op path there. Off-GPU (no backend) the kernels fall back to their references;
# the CUDA set keeps the CPU tests on the same call path as CUDA.
DEFAULT_FAMILIES = {
    "cuda": frozenset({"gdn", "moe", "qmv", "mamba", "route", "attn"}),
    "metal": frozenset(),
    None: frozenset({"gdn", "moe", "qmv", "mamba", "route", "attn"}),
}


def enabled(name: str, options: KernelOptions) -> bool:
    """Whether the model may use kernel family `name` (options.KERNEL_FAMILIES): the families
    `options` names, or this backend's DEFAULT_FAMILIES when it names none."""
    families = DEFAULT_FAMILIES[backend()] if options.families is None else options.families
    return name in families
