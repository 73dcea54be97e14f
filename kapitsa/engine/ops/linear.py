"""Quantized linears that pick their mat-mul by the number of input rows, on MLX's CUDA backend.

`route_for` is the one routing table (lab/diag_h200.py times each route; figures in
docs/results.md):
- one row (decode): the one-row kernel (kernels/matvec_one_row.py; 1569 GB/s over a 27B chain
  against stock's 935), which also takes the RMSNorm before a projection and the residual add
  after it (`normed_linear`, `linear_plus`, ...);
- 2-16 rows (speculative verification): the tensor-core kernel (kernels/matvec_tensor_core.py;
  bf16, 4-bit, group 64/128; 10.1 ms against stock's 53.9 at 4 rows), its two-block variant past
  8 rows;
- other 1-8 row calls (8-bit, fp16/fp32 activations): the general kernel (kernels/matvec.py);
- with `KernelOptions.exact_verify`, 2-8 rows take the one-row kernel too (fused parts included):
  its rows come out bit for bit as one-row calls would, which the tensor-core kernel's do not;
- prefill (from DEQUANT_MIN_ROWS rows): the weights dequantized to the activation dtype and a
  dense mat-mul, which outruns stock `quantized_matmul` there (the dense copy is transient);
- anything else: MLX's stock layer.

`route_quantized_linears(model, options)` re-classes every `nn.QuantizedLinear` as
`RoutedQuantizedLinear` (same parameters, same state dict; only `__call__` differs), after
projection fusion. Off CUDA it is the stock layer. The routes are exact rewrites of the same
product; float32 accumulation throughout.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from kapitsa.engine import kernels
from kapitsa.engine.kernels import backend, cpu_blas
from kapitsa.engine.kernels.matvec import MAX_ROWS, qmv_general, qmv_reference, supports_general
from kapitsa.engine.kernels.matvec_one_row import (
    qmv_one_row,
    qmv_one_row_reference,
    supports_fused,
    supports_one_row,
)
from kapitsa.engine.kernels.matvec_tensor_core import MAX_ROWS as TENSOR_CORE_MAX_ROWS
from kapitsa.engine.kernels.matvec_tensor_core import qmv_tensor_core, supports_tensor_core
from kapitsa.engine.options import KernelOptions

DEQUANT_MIN_ROWS = 384  # below, the dense copy costs more than stock's slower mat-mul saves
DEQUANT_MAX_BYTES = 1 << 30  # the transient dense weight; the vocabulary head at prefill stays stock
_log = logging.getLogger(__name__)

# Kernels that compiled, ran and agreed with the reference in this process (`probe_kernels`).
# A kernel's failure surfaces only when a graph is evaluated, in the middle of a forward (and the
# first call may sit inside a compiled decode step, where nothing may be evaluated), so every
# kernel is tried once on a small case before any route may use it; unprobed means unused.
WORKING: dict[str, bool] = {}
# kernel (tensor_core_16: the tensor-core kernel's two-block variant, 9-16 rows) -> rows it is
# probed at (fused: the one-row kernel with the RMSNorm prologue and residual epilogue)
PROBES = {"one_row": 1, "tensor_core": 2, "general": 2, "tensor_core_16": 12, "fused": 1}


def routes_enabled(options: KernelOptions) -> bool:
    """CUDA only (Metal's stock kernels are tuned; CPU has no kernel); `options.routed_linears`
    False turns every route off, a family list without "qmv" the kernel routes only."""
    return backend() == "cuda" and options.routed_linears


def _kernel_call(name: str, x: mx.array, w, scales, biases, group_size: int, bits: int, **fused) -> mx.array:
    """`fused`: `norm=(weight, eps)`, `residual=`, `act=`, `glu=` (the one-row kernel)."""
    if name in ("one_row", "fused"):
        return qmv_one_row(x, w, scales, biases, group_size=group_size, bits=bits, **fused)
    if name == "tensor_core":
        return qmv_tensor_core(x, w, scales, biases, group_size=group_size)
    return qmv_general(x, w, scales, biases, group_size=group_size, bits=bits)


def probe_kernels(options: KernelOptions) -> dict[str, bool]:
    """Try each mat-vec kernel once (bf16, 4-bit, group 64, at the rows of `PROBES`) against the
    reference; record which work. Idempotent; call it outside any `mx.compile` trace."""
    for name, rows in PROBES.items():
        if name in WORKING or (name == "fused" and not options.fused_parts):
            continue  # (no compile of the fused form where nothing is fused)
        keys = mx.random.split(mx.random.key(7), 3)  # own keys: the global seed stays untouched
        w = (0.05 * mx.random.normal((64, 256), key=keys[0])).astype(mx.bfloat16)
        q, scales, biases = mx.quantize(w, group_size=64, bits=4)
        x = mx.random.normal((rows, 256), key=keys[1]).astype(mx.bfloat16)
        fused = {}
        if name == "fused":
            norm_weight = (1 + 0.2 * mx.random.normal((256,), key=keys[2])).astype(mx.bfloat16)
            fused = dict(norm=(norm_weight, 1e-6), residual=x[:, :64])
            ref = qmv_one_row_reference(x, q, scales, biases, group_size=64, bits=4, **fused)
        else:
            ref = qmv_reference(x.astype(mx.float32), q, scales, biases, group_size=64, bits=4)
        ref = ref.astype(mx.float32)
        try:
            got = _kernel_call(name.removesuffix("_16"), x, q, scales, biases, 64, 4, **fused).astype(
                mx.float32
            )
            err = float(mx.abs(got - ref).max() / mx.abs(ref).max())
        except (RuntimeError, ValueError) as exc:
            _log.warning("quantized mat-vec kernel %s unavailable, using the stock one: %s", name, exc)
            WORKING[name] = False
            continue
        WORKING[name] = err < 1e-2
        if not WORKING[name]:
            _log.warning(
                "quantized mat-vec kernel %s disagrees with the reference (%.3g); not using it", name, err
            )
    return dict(WORKING)


def route_for(rows: int, layer: RoutedQuantizedLinear, x: mx.array) -> str:
    """'one_row', 'tensor_core', 'general' (kernels), 'dequant' or 'stock' for a call with `rows`
    input rows: the routing table of the module docstring."""
    kernel_routes = layer.mode == "affine" and kernels.enabled("qmv", layer.kernel_options)
    if rows <= MAX_ROWS:
        if not kernel_routes:
            return "stock"
        args = (x, layer["weight"], layer["scales"], layer.get("biases"))
        quant = dict(group_size=layer.group_size, bits=layer.bits)
        one_row = rows == 1 or layer.kernel_options.exact_verify
        if one_row and WORKING.get("one_row") and supports_one_row(*args, **quant):
            return "one_row"
        if WORKING.get("tensor_core") and supports_tensor_core(*args, **quant):
            return "tensor_core"
        if WORKING.get("general") and supports_general(*args, **quant):
            return "general"
        return "stock"
    if rows <= TENSOR_CORE_MAX_ROWS and kernel_routes and WORKING.get("tensor_core_16"):
        args = (x, layer["weight"], layer["scales"], layer.get("biases"))
        if supports_tensor_core(*args, group_size=layer.group_size, bits=layer.bits):
            return "tensor_core"  # long drafts' verification (9-16 rows)
    dense_bytes = layer["weight"].shape[0] * x.shape[-1] * x.dtype.size
    if rows >= DEQUANT_MIN_ROWS and dense_bytes <= DEQUANT_MAX_BYTES:
        return "dequant"
    return "stock"


def _by_blas(layer: nn.Module, x: mx.array) -> bool:
    """Whether a routed linear's product goes through CPU BLAS: a prefill's many tokens, or a
    step of few rows when the layer keeps its float32 copy (no dequantizing per call)."""
    if cpu_blas.takes_rows(x):
        return True
    return layer.keeps_dense_copy and cpu_blas.takes_step_rows(x, layer.kernel_options.cpu_blas_rows)


class RoutedQuantizedLinear(nn.QuantizedLinear):
    """`nn.QuantizedLinear` whose product goes through the route measured fastest for its rows."""

    keeps_dense_copy = False  # set per layer by route_quantized_linears (CPU BLAS route)
    kernel_options = KernelOptions()  # set per layer by route_quantized_linears

    def __call__(self, x: mx.array) -> mx.array:
        if _by_blas(self, x) and (y := cpu_blas.linear(self, x, keep=self.keeps_dense_copy)) is not None:
            return y
        rows = math.prod(x.shape[:-1])
        if not routes_enabled(self.kernel_options):
            return super().__call__(x)
        if self.kernel_options.exact_verify and splits_tokens(x) and not one_call_is_exact(x):
            return rows_apart(self, x)  # each token's rows as a decode step's call
        route = route_for(rows, self, x)
        if route == "stock":
            return super().__call__(x)
        w, scales, biases = self["weight"], self["scales"], self.get("biases")
        if route == "dequant":
            dense = mx.dequantize(
                w, scales, biases, group_size=self.group_size, bits=self.bits, mode=self.mode
            )
            y = x @ dense.astype(x.dtype).T
        else:  # the kernels take x [..., K] and return [..., N]: no reshapes to encode
            y = _kernel_call(route, x, w, scales, biases, self.group_size, self.bits)
        if "bias" in self:
            y = y + self["bias"]
        return y


def one_call_is_exact(x: mx.array) -> bool:
    """With exact_verify: whether one kernel call on x `[..., T, K]` computes each row as a decode
    step's call would: one sequence of up to MAX_ROWS tokens through the one-row kernel, whose rows
    do not depend on how many it takes. A batch of sequences goes token by token (rows_apart)."""
    return x.ndim < 2 or (math.prod(x.shape[:-2]) == 1 and x.shape[-2] <= MAX_ROWS)


def _fused_kernel(linear: nn.Module, x: mx.array, part: str) -> str | None:
    """The fused kernel ("fused": the one-row kernel with prologue / epilogue) that may take the
    call `linear(x)` with `part` (one of FUSED_PARTS) switched on, or None: one-row calls, and
    with `exact_verify` calls of up to MAX_ROWS rows (a verify computes what decode steps do)."""
    if not (
        isinstance(linear, RoutedQuantizedLinear)
        and part in linear.kernel_options.fused_parts
        and "bias" not in linear
        and routes_enabled(linear.kernel_options)
    ):
        return None
    rows = math.prod(x.shape[:-1])
    if rows > 1 and not (linear.kernel_options.exact_verify and one_call_is_exact(x)):
        return None
    if route_for(rows, linear, x) != "one_row" or not WORKING.get("fused", False):
        return None
    return "fused"


def _fused_call(name: str, linear: RoutedQuantizedLinear, x: mx.array, **fused) -> mx.array:
    return _kernel_call(
        name,
        x,
        linear["weight"],
        linear["scales"],
        linear["biases"],
        linear.group_size,
        linear.bits,
        **fused,
    )


def normed_linear(norm: nn.Module, linear: nn.Module, x: mx.array) -> mx.array:
    """`linear(norm(x))`: one kernel at decode (the RMSNorm inside the one-row mat-vec) where the
    fused route takes it (CUDA, a plain `nn.RMSNorm`, a routed one-row call), else as written."""
    name = _fused_kernel(linear, x, "norm") if type(norm) is nn.RMSNorm else None
    if name is not None and supports_fused(x, linear["weight"].shape[0], norm.weight, None):
        return _fused_call(name, linear, x, norm=(norm.weight, norm.eps))
    return linear(norm(x))


def linear_plus(linear: nn.Module, h: mx.array, residual: mx.array) -> mx.array:
    """`residual + linear(h)`: the add in the one-row mat-vec's epilogue where the fused route
    takes it, else as written."""
    name = _fused_kernel(linear, h, "residual")
    if (
        name is not None
        and residual.shape[:-1] == h.shape[:-1]
        and supports_fused(h, linear["weight"].shape[0], None, residual)
    ):
        return _fused_call(name, linear, h, residual=residual)
    return residual + linear(h)


def glu_linear(linear: nn.Module, x: mx.array, norm: nn.Module | None = None) -> mx.array | None:
    """silu(gate) * up of `linear([norm](x))`, a [gate | up] projection, made in the one-row
    mat-vec's epilogue (part "glu", with the norm in its prologue when part "norm" is on too), or
    None where the fused route does not take this call (the caller then runs the ops)."""
    name = _fused_kernel(linear, x, "glu")
    if name is None:
        return None
    in_prologue = type(norm) is nn.RMSNorm and "norm" in linear.kernel_options.fused_parts
    n = linear["weight"].shape[0]
    if n % 2 or not supports_fused(x, n, norm.weight if in_prologue else None, None):
        return None
    if in_prologue:
        return _fused_call(name, linear, x, norm=(norm.weight, norm.eps), glu=True)
    return _fused_call(name, linear, x if norm is None else norm(x), glu=True)


def act_linear_plus(
    linear: nn.Module, x: mx.array, residual: mx.array, act: str, fallback: Callable[[mx.array], mx.array]
) -> mx.array:
    """`residual + linear(fallback(x))`, where `fallback` computes the activation `act`
    (matvec_one_row.ACTS: "silu_glu" on x = [gate | up], "relu2"); at decode, the activation is made
    as the one-row mat-vec loads x and the add is in its epilogue."""
    k = x.shape[-1] // 2 if act == "silu_glu" else x.shape[-1]
    product_input = x[..., :k]  # the shape the product sees, for the route checks
    name = _fused_kernel(linear, product_input, "act")
    if (
        name is not None
        and residual.shape[:-1] == x.shape[:-1]
        and supports_fused(product_input, linear["weight"].shape[0], None, residual)
    ):
        return _fused_call(name, linear, x, residual=residual, act=act)
    return linear_plus(linear, fallback(x), residual)


class RoutedLinear(nn.Linear):
    """`nn.Linear` whose many-row products take the CPU BLAS route (kernels/cpu_blas.py), and with
    `exact_verify` on CUDA whose 2-16 row products run one row per matrix-vector product, as a
    decode step's do (a many-row product is a GEMM there, whose rows round differently). Dense
    linears are re-classed on the CPU device, and on CUDA with exact_verify."""

    keeps_dense_copy = False
    kernel_options = KernelOptions()  # set per layer by route_quantized_linears

    def __call__(self, x: mx.array) -> mx.array:
        if _by_blas(self, x) and (y := cpu_blas.linear(self, x, keep=self.keeps_dense_copy)) is not None:
            return y
        if self.kernel_options.exact_verify:
            return self.row_by_row(x)
        return super().__call__(x)

    def row_by_row(self, x: mx.array) -> mx.array:
        return rows_apart(super().__call__, x)


def splits_tokens(x: mx.array) -> bool:
    """Whether `rows_apart` makes x `[..., T, K]` one call per token: 2-16 tokens, on CUDA."""
    return backend() == "cuda" and x.ndim >= 2 and 1 < x.shape[-2] <= TENSOR_CORE_MAX_ROWS


def rows_apart(product: Callable[[mx.array], mx.array], x: mx.array) -> mx.array:
    """`product(x)` for x `[..., T, K]` as T calls on `[..., 1, K]`, on CUDA for 2-16 tokens: the
    calls a decode step makes. MLX computes a product of one row per sequence with a matrix-vector
    kernel and one of many rows with a GEMM (it folds every leading axis into the rows), whose rows
    round differently. Elsewhere, or past 16 tokens, `product(x)` as it is. T launches, and the
    weights read once per token."""
    if not splits_tokens(x):
        return product(x)
    return mx.concatenate([product(x[..., t : t + 1, :]) for t in range(x.shape[-2])], axis=-2)


ROUTED = {nn.QuantizedLinear: RoutedQuantizedLinear, nn.Linear: RoutedLinear}


def route_quantized_linears(model: nn.Module, options: KernelOptions, *, dense_copy_bytes: int = 0) -> int:
    """Re-class the model's linears in place (probing the kernels first where the routes apply);
    returns how many. `options`: the kernels and fused parts the routes may use.
    `dense_copy_bytes`: how much float32 copy of their weights the CPU BLAS route may keep between
    calls (layers past the budget dequantize per call). Idempotent."""
    if routes_enabled(options):
        probe_kernels(options)
    count, kept = 0, 0
    routes = (
        ROUTED if cpu_blas.on_cpu() or options.exact_verify else {nn.QuantizedLinear: RoutedQuantizedLinear}
    )
    for _, sub in model.named_modules():
        routed = routes.get(type(sub))
        if routed is None and not isinstance(sub, tuple(ROUTED.values())):
            continue
        if routed is not None:
            sub.__class__ = routed
            count += 1
        if isinstance(sub, (RoutedQuantizedLinear, RoutedLinear)):
            sub.kernel_options = options
        copy_bytes = cpu_blas.dense_bytes(sub)
        sub.keeps_dense_copy = kept + copy_bytes <= dense_copy_bytes
        kept += copy_bytes if sub.keeps_dense_copy else 0
    return count


def keeps_every_dense_copy(model: nn.Module) -> bool:
    """Whether every routed linear of `model` keeps its float32 copy (route_quantized_linears)."""
    routed = _routed_linears(model)
    return bool(routed) and all(m.keeps_dense_copy for m in routed)


def kept_dense_bytes(model: nn.Module) -> int:
    """Bytes of the float32 copies `model`'s routed linears keep."""
    return sum(cpu_blas.dense_bytes(m) for m in _routed_linears(model) if m.keeps_dense_copy)


def _routed_linears(model: nn.Module) -> list[nn.Module]:
    return [m for _, m in model.named_modules() if isinstance(m, (RoutedQuantizedLinear, RoutedLinear))]
