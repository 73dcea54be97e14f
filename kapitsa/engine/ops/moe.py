"""Routed experts: stacked per-expert weights run with `mx.gather_mm` / `mx.gather_qmm`.

Parameter names (`weight`, `scales`, `biases`, `bias`) and layouts (`[E, out, in]`) match
mlx-lm's, so MLX checkpoints published by mlx-community load unchanged.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from kapitsa.engine.ops.norm import relu_squared, silu_mul
from kapitsa.engine.options import KernelOptions

_SORT_THRESHOLD = 64  # token-expert pairs above which grouping rows by expert pays off

# Prefill on CUDA: MLX's gather_qmm there runs each (token, expert) row as its own M = 1 product
# (qmm_sm80 over lhs/rhs indices; `sorted_indices` is not used), while gather_mm on rows sorted by
# expert is one CUTLASS grouped GEMM. So a call with at least `min_rows` sorted rows dequantizes
# the expert stack to the activation dtype (a transient copy of at most `max_bytes`) and takes the
# grouped GEMM (KernelOptions.moe_dequant).
MOE_DEQUANT_MIN_ROWS = 512
MOE_DEQUANT_MAX_BYTES = 3 << 30


def _cpu_only() -> bool:
    cuda = getattr(mx, "cuda", None)
    return not (mx.metal.is_available() or (cuda is not None and cuda.is_available()))


_CPU_GATHER_FP32_ONLY = _cpu_only()


class SwitchLinear(nn.Module):
    """E linear maps `[E, out, in]`; row i of x goes through expert `indices[i]`."""

    def __init__(self, in_dims: int, out_dims: int, num_experts: int, bias: bool = False):
        super().__init__()
        scale = math.sqrt(1 / in_dims)
        self.weight = mx.random.uniform(-scale, scale, (num_experts, out_dims, in_dims))
        if bias:
            self.bias = mx.zeros((num_experts, out_dims))

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        weight = self["weight"]
        if _CPU_GATHER_FP32_ONLY and weight.dtype != mx.float32:
            # MLX's CPU gather_mm takes float32 only: compute in float32 there and cast back
            out = mx.gather_mm(
                x.astype(mx.float32),
                weight.astype(mx.float32).swapaxes(-1, -2),
                rhs_indices=indices,
                sorted_indices=sorted_indices,
            ).astype(x.dtype)
        else:
            out = mx.gather_mm(x, weight.swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices)
        if "bias" in self:
            out = out + mx.expand_dims(self["bias"][indices], -2)
        return out

    def to_quantized(
        self, group_size: int = 64, bits: int = 4, mode: str = "affine"
    ) -> QuantizedSwitchLinear:
        return QuantizedSwitchLinear.from_switch_linear(self, group_size, bits, mode)


class QuantizedSwitchLinear(nn.Module):
    """`SwitchLinear` with quantized expert weights (affine, mxfp4, nvfp4, ... as `mx.quantize`)."""

    kernel_options = KernelOptions()  # set by models.base.use_kernel_options

    def __init__(self, in_dims, out_dims, num_experts, bias=False, group_size=64, bits=4, mode="affine"):
        super().__init__()
        self.group_size, self.bits, self.mode = group_size, bits, mode
        parts = mx.quantize(mx.zeros((num_experts, out_dims, in_dims)), group_size, bits, mode=mode)
        self.weight, self.scales = parts[0], parts[1]
        if len(parts) > 2 and parts[2] is not None:
            self.biases = parts[2]
        if bias:
            self.bias = mx.zeros((num_experts, out_dims))
        self.freeze()

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        if _dequant_route(self, x, indices, sorted_indices):
            out = _dequant_gather(self, x, indices)
            if "bias" in self:
                out = out + mx.expand_dims(self["bias"][indices], -2)
            return out
        out = mx.gather_qmm(
            x,
            self["weight"],
            self["scales"],
            self.get("biases"),
            rhs_indices=indices,
            transpose=True,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
            sorted_indices=sorted_indices,
        )
        if "bias" in self:
            out = out + mx.expand_dims(self["bias"][indices], -2)
        return out

    @classmethod
    def from_switch_linear(cls, layer: SwitchLinear, group_size: int, bits: int, mode: str):
        E, out_dims, in_dims = layer.weight.shape
        q = cls(in_dims, out_dims, E, "bias" in layer, group_size, bits, mode)
        parts = mx.quantize(layer.weight, group_size, bits, mode=mode)
        q.weight, q.scales = parts[0], parts[1]
        if "biases" in q:
            q.biases = parts[2]
        if "bias" in layer:
            q.bias = layer.bias
        return q


def _dequant_route(
    layer: QuantizedSwitchLinear, x: mx.array, indices: mx.array, sorted_indices: bool
) -> bool:
    """Whether this call takes the dequantize + grouped GEMM route (KernelOptions.moe_dequant): CUDA, rows sorted
    by expert, enough of them, a float activation and a stack whose dense copy fits the budget."""
    from kapitsa.engine.kernels import backend  # looked up per call: tests stand in a backend

    if not (layer.kernel_options.moe_dequant and sorted_indices and indices.size >= MOE_DEQUANT_MIN_ROWS):
        return False
    experts, out_dims = layer["weight"].shape[:2]
    dense_bytes = experts * out_dims * x.shape[-1] * x.dtype.size
    return (
        backend() == "cuda" and x.dtype in (mx.bfloat16, mx.float16) and dense_bytes <= MOE_DEQUANT_MAX_BYTES
    )


def _dequant_gather(layer: QuantizedSwitchLinear, x: mx.array, indices: mx.array) -> mx.array:
    """`gather_qmm` of `layer` as gather_mm over its dequantized stack (rows sorted by expert)."""
    dense = mx.dequantize(
        layer["weight"],
        layer["scales"],
        layer.get("biases"),
        group_size=layer.group_size,
        bits=layer.bits,
        mode=layer.mode,
    ).astype(x.dtype)
    if _CPU_GATHER_FP32_ONLY:  # (the tests' CPU: gather_mm takes float32 only there)
        out = mx.gather_mm(
            x.astype(mx.float32),
            dense.astype(mx.float32).swapaxes(-1, -2),
            rhs_indices=indices,
            sorted_indices=True,
        )
        return out.astype(x.dtype)
    return mx.gather_mm(x, dense.swapaxes(-1, -2), rhs_indices=indices, sorted_indices=True)


def _expert_rows(x: mx.array, indices: mx.array):
    """Flatten (token, slot) pairs and sort them by expert so each expert's rows are contiguous."""
    k = indices.shape[-1]
    flat = indices.flatten()
    order = mx.argsort(flat)
    return x.flatten(0, -3)[order // k], flat[order], mx.argsort(order)


def _run_experts(x: mx.array, indices: mx.array, body) -> mx.array:
    """x `[..., D]`, indices `[..., k]` -> `[..., k, D_out]`: `body(x_rows, idx, sorted)`."""
    x = mx.expand_dims(x, (-2, -3))
    if indices.size < _SORT_THRESHOLD:
        return body(x, indices, False).squeeze(-2)
    rows, idx, inverse = _expert_rows(x, indices)
    out = body(rows, idx, True)[inverse]
    return mx.unflatten(out.squeeze(-2), 0, indices.shape)


class SwitchGLU(nn.Module):
    """SwiGLU experts (Qwen MoE): down(silu(gate(x)) * up(x))."""

    def __init__(self, dims: int, hidden: int, num_experts: int):
        super().__init__()
        self.gate_proj = SwitchLinear(dims, hidden, num_experts)
        self.up_proj = SwitchLinear(dims, hidden, num_experts)
        self.down_proj = SwitchLinear(hidden, dims, num_experts)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        def body(rows, idx, srt):
            h = silu_mul(self.gate_proj(rows, idx, srt), self.up_proj(rows, idx, srt))
            return self.down_proj(h, idx, srt)

        return _run_experts(x, indices, body)


class SwitchReluSquared(nn.Module):
    """Non-gated relu^2 experts (Nemotron-H MoE): fc2(relu(fc1(x))^2)."""

    def __init__(self, dims: int, hidden: int, num_experts: int, bias: bool = False):
        super().__init__()
        self.fc1 = SwitchLinear(dims, hidden, num_experts, bias)
        self.fc2 = SwitchLinear(hidden, dims, num_experts, bias)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        def body(rows, idx, srt):
            return self.fc2(relu_squared(self.fc1(rows, idx, srt)), idx, srt)

        return _run_experts(x, indices, body)


def experts_reference(x: mx.array, indices: mx.array, expert_fn) -> mx.array:
    """Definition: `out[..., j, :] = expert_fn(e, x)` for e = indices[..., j]; a loop over experts
    with dense masks. Used by the tests to pin the gather paths."""
    out = None
    for e in range(int(indices.max().item()) + 1):
        y = expert_fn(e, x)[..., None, :]  # [..., 1, D]
        hit = (indices == e)[..., None]
        out = mx.where(hit, y, 0.0) if out is None else out + mx.where(hit, y, 0.0)
    return out


def topk_indices(scores: mx.array, k: int) -> mx.array:
    """Indices of the k largest scores along the last axis (unordered)."""
    return mx.argpartition(-scores, kth=k - 1, axis=-1)[..., :k]
