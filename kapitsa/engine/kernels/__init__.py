"""Backend kernels, each beside a plain MLX-ops reference it is tested against.

`backend()` says which custom-kernel path this process can use ("cuda", "metal" or None); every
public op falls back to its reference when there is no kernel for the backend, never fails.
"""

from __future__ import annotations

import functools

import mlx.core as mx


@functools.cache
def backend() -> str | None:
    if mx.default_device().type != mx.DeviceType.gpu:
        return None
    if mx.cuda.is_available():
        return "cuda"
    if mx.metal.is_available():
        return "metal"
    return None
