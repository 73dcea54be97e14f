"""Quantized linears that pick their mat-mul by the number of input rows, on MLX's CUDA backend.

Measured on the H200 (bench/diag_h200.py, docs/bench/decode-h200.md), MLX 0.32.4:
- Decode (1-8 rows): the stock affine 4-bit mat-vec streamed a Qwen3.5-27B layer chain at
  0.92 TB/s, kapitsa's v2 kernel (kernels/qmv_fast.py) at 1.41 TB/s; at 4 rows (speculative
  verification) 0.25 against 0.94 TB/s.
  Then (same chain, one run): at 1 row v3 "direct" (kernels/qmv_direct.py) 1.57 TB/s, v2 1.38,
  the tensor-core kernel (kernels/qmv_tc.py) 1.33; at 4 rows tensor-core 1.37, v2 0.98, direct
  0.73. So one row goes to direct, 2-8 rows to tensor-core (bf16, 4-bit, group 64/128), anything
  else affine 4/8-bit to v2.
- Prefill (512 rows): stock `quantized_matmul` ran at 138 TFLOP/s, dequantizing to the activation
  dtype and running a dense mat-mul at 275 TFLOP/s (the dequantized copy is transient).

`route_quantized_linears(model)` re-classes every `nn.QuantizedLinear` as `RoutedQuantizedLinear`
(same parameters, same state dict; only `__call__` differs), after projection fusion. Off CUDA,
and for calls neither route takes (other formats or bit widths, mid-size batches), it is the stock
layer. The routes are exact rewrites of the same product; float32 accumulation throughout.
"""

from __future__ import annotations

import math
import os

import mlx.core as mx
import mlx.nn as nn

from kapitsa.engine.kernels import backend
from kapitsa.engine.kernels.qmv_direct import qmv_direct, supports_direct
from kapitsa.engine.kernels.qmv_fast import MAX_ROWS, qmv_fast, supports_fast
from kapitsa.engine.kernels.qmv_tc import qmv_tc, supports_tc

DEQUANT_MIN_ROWS = 384  # below, the dense copy costs more than stock's slower mat-mul saves
DEQUANT_MAX_BYTES = 1 << 30  # the transient dense weight; the vocabulary head at prefill stays stock


def routes_enabled() -> bool:
    """CUDA only (Metal's stock kernels are tuned; CPU has no kernel); KAPITSA_QLINEAR=stock turns
    the routes off for A/B runs."""
    return backend() == "cuda" and os.environ.get("KAPITSA_QLINEAR", "").strip().lower() != "stock"


def route_for(rows: int, layer: nn.QuantizedLinear, x: mx.array) -> str:
    """'kernel', 'dequant' or 'stock' for a call with `rows` input rows."""
    if rows <= MAX_ROWS:
        x2 = x.reshape(rows, x.shape[-1])
        biases = layer.get("biases")
        ok = supports_fast(
            x2, layer["weight"], layer["scales"], biases, group_size=layer.group_size, bits=layer.bits
        )
        return "kernel" if ok and layer.mode == "affine" else "stock"
    dense_bytes = layer["weight"].shape[0] * x.shape[-1] * x.dtype.size
    if rows >= DEQUANT_MIN_ROWS and dense_bytes <= DEQUANT_MAX_BYTES:
        return "dequant"
    return "stock"


class RoutedQuantizedLinear(nn.QuantizedLinear):
    """`nn.QuantizedLinear` whose product goes through the route measured fastest for its rows."""

    def __call__(self, x: mx.array) -> mx.array:
        if not routes_enabled():
            return super().__call__(x)
        rows = math.prod(x.shape[:-1])
        route = route_for(rows, self, x)
        if route == "stock":
            return super().__call__(x)
        w, scales, biases = self["weight"], self["scales"], self.get("biases")
        if route == "kernel":
            x2 = x.reshape(rows, x.shape[-1])
            if rows == 1 and supports_direct(
                x2, w, scales, biases, group_size=self.group_size, bits=self.bits
            ):
                y = qmv_direct(x2, w, scales, biases, group_size=self.group_size, bits=self.bits)
            elif supports_tc(x2, w, scales, biases, group_size=self.group_size, bits=self.bits):
                y = qmv_tc(x2, w, scales, biases, group_size=self.group_size)
            else:
                y = qmv_fast(x2, w, scales, biases, group_size=self.group_size, bits=self.bits)
            y = y.reshape(*x.shape[:-1], w.shape[0])
        else:
            dense = mx.dequantize(
                w, scales, biases, group_size=self.group_size, bits=self.bits, mode=self.mode
            )
            y = x @ dense.astype(x.dtype).T
        if "bias" in self:
            y = y + self["bias"]
        return y


def route_quantized_linears(model: nn.Module) -> int:
    """Re-class the model's quantized linears in place; returns how many. Idempotent."""
    count = 0
    for _, sub in model.named_modules():
        if type(sub) is nn.QuantizedLinear:
            sub.__class__ = RoutedQuantizedLinear
            count += 1
    return count
