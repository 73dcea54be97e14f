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


def enabled(name: str) -> bool:
    """Whether the model may use kernel family `name` ("gdn", "mamba", "moe", "qmv").

    `KAPITSA_KERNELS` = "all" (default), "none", or a comma list of the families to use: a way to
    A/B a kernel against its reference path without code changes (the bench uses it)."""
    import os

    value = os.environ.get("KAPITSA_KERNELS", "all").strip().lower()
    if value in ("", "all"):
        return True
    return name in {v.strip() for v in value.split(",")}
