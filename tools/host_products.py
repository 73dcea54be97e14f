"""Products through NumPy for drafter training on a CPU (tools/train_mtp_head.py,
tools/train_block_drafter.py): the target's frozen LM head and the drafter's own linears, forward
and backward.

MLX's Linux CPU build multiplies through the reference BLAS at ~2 GFLOP/s, and a drafter's step is
almost only products; NumPy's OpenBLAS runs them ~40x faster. On a GPU device the MLX ops serve.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np


def _host(x: mx.array) -> np.ndarray:
    return np.asarray(x.astype(mx.float32))


def host_head(model: nn.Module):  # noqa: ANN201 - an mx.custom_function
    """`model.head()` as an `mx.custom_function` over NumPy products (float32 logits); off the CPU
    device, the head's own MLX op."""
    if mx.default_device().type != mx.DeviceType.cpu:
        return lambda h: model.head()(h).astype(mx.float32)
    weight = _host(model.head()(mx.eye(model.args.hidden_size))).T  # [V, H]

    @mx.custom_function
    def head(h: mx.array) -> mx.array:
        return mx.array(_host(h) @ weight.T)

    @head.vjp
    def head_vjp(primals, cotangent, output):  # noqa: ANN001, ANN202
        return (mx.array(_host(cotangent) @ weight),)

    return head


@mx.custom_function
def host_linear(x: mx.array, weight: mx.array) -> mx.array:
    """`x @ weight.T` for x `[..., in]`, weight `[out, in]`, in float32 through NumPy."""
    rows = _host(x).reshape(-1, x.shape[-1])
    return mx.array((rows @ _host(weight).T).reshape(*x.shape[:-1], weight.shape[0]))


@host_linear.vjp
def _host_linear_vjp(primals, cotangent, output):  # noqa: ANN001, ANN202
    x, weight = primals
    dy = _host(cotangent).reshape(-1, weight.shape[0])
    rows = _host(x).reshape(-1, x.shape[-1])
    dx = (dy @ _host(weight)).reshape(x.shape)
    return mx.array(dx).astype(x.dtype), mx.array(dy.T @ rows).astype(weight.dtype)


class HostLinear(nn.Linear):
    """`nn.Linear` (no bias) whose product runs in `host_linear`; same parameters and names."""

    def __call__(self, x: mx.array) -> mx.array:
        return host_linear(x, self.weight)


def host_linears(model: nn.Module) -> int:
    """Re-class `model`'s bias-free `nn.Linear`s as `HostLinear` on the CPU device; returns how many."""
    if mx.default_device().type != mx.DeviceType.cpu:
        return 0
    count = 0
    for _, sub in model.named_modules():
        if type(sub) is nn.Linear and "bias" not in sub:
            sub.__class__ = HostLinear
            count += 1
    return count
