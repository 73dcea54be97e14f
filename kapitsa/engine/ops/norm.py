"""RMS norms. Checkpoint quirks (Qwen's zero-centred `1 + w` weights) are folded in `sanitize`."""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import mlx.nn as nn


@partial(mx.compile, shapeless=True)
def _times_silu_f32(normed: mx.array, gate: mx.array) -> mx.array:
    gate = gate.astype(mx.float32)
    return (normed.astype(mx.float32) * (gate * mx.sigmoid(gate))).astype(normed.dtype)


@partial(mx.compile, shapeless=True)
def silu_mul(gate: mx.array, x: mx.array) -> mx.array:
    """`silu(gate) * x` as one kernel (SwiGLU MLPs, the Mamba-2 output gate)."""
    return nn.silu(gate) * x


@partial(mx.compile, shapeless=True)
def relu_squared(x: mx.array) -> mx.array:
    return mx.square(nn.relu(x))


class GatedRMSNorm(nn.Module):
    """Qwen GDN output norm: `rms_norm(x) * w * silu(z)`, the gate applied in float32."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = mx.ones((dims,))

    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        return _times_silu_f32(mx.fast.rms_norm(x, self.weight, self.eps), gate)


class GroupGatedRMSNorm(nn.Module):
    """Mamba-2 output norm: `x * silu(gate)`, then an RMS norm within each of `groups` groups."""

    def __init__(self, dims: int, eps: float, group_size: int):
        super().__init__()
        self.eps = eps
        self.group_size = group_size
        self.weight = mx.ones((dims,))

    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        x = silu_mul(gate, x)
        grouped = mx.unflatten(x, -1, (-1, self.group_size))
        grouped = mx.fast.rms_norm(grouped, None, self.eps)
        return self.weight * grouped.flatten(-2)
