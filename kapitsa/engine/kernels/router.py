"""Fused MoE router for short steps (decode and verification): the router's logits, the family's
scores, the top-k experts and their weights in two CUDA kernels.

Why: at batch 1 on MLX's CUDA backend a decode step costs the host ~3-5 us per primitive
(lab/host_costs.py), and an MoE layer's routing is ~10 of them (a transposed weight, the
matmul's reshapes, casts, softmax or sigmoid, argpartition, take_along_axis, the sum and the
division); lab/graph_census.py counts 10-12 fewer primitives per MoE layer with these two.
1. cuda_src/router_logits.cu: float32 logits, one warp per (token, weight row), so the router
   weight (1 MiB for Qwen3.5-35B-A3B, 0.7 MiB for Nemotron-3-Nano) streams over many SMs.
2. cuda_src/router_select.cu: one warp per token scores the logits, picks the top k (k rounds of
   a warp argmax) and writes the indices, the weights and any extra rows' logits.

Modes (the reference, `route_reference`, is each model's own routing math):
- "softmax" (Qwen3.5/3.6 MoE): probs = softmax(logits as x's dtype), the top-k by prob, weights =
  their probs (renormalised to sum 1 with `normalize`). Extra weight rows after the experts (the
  fused shared-expert gate) come back as logits in x's dtype.
- "sigmoid" (Nemotron-H, one expert group): scores = sigmoid(fp32 logits), the top-k of scores +
  bias, weights = their scores (/ (sum + 1e-20) with `normalize`) times `scale`.
- `shared=(first, count)`: shared experts folded into the routed stacks (loading/moe_fold.py) come
  after the top k in every row, at weight sigmoid(the first extra row's logit) where
  `shared_gate` (Qwen's gated shared expert), else 1 (Nemotron's): the selecting kernel writes
  them, where the op path takes four primitives a layer to append them.

Kernel family "route" (on by default on CUDA). `route` falls back to the reference off
CUDA, for shapes it does not take, and unless `probe()` ran and passed: it evaluates, so it runs
before any compiled trace (the engine's ModelRunner calls it), never inside one.
"""

from __future__ import annotations

import functools
import logging
import math

import mlx.core as mx
import mlx.nn as nn

from kapitsa.engine.kernels import backend, float_bits
from kapitsa.engine.kernels.cuda import CudaKernel, read_cuda_source
from kapitsa.engine.loading.moe_fold import shared_slots
from kapitsa.engine.ops.moe import topk_indices

MODES = ("softmax", "sigmoid")
MAX_TOKENS = 16  # one block per token: decode and verification; prefill keeps the op path
MAX_EXPERTS = 1024  # 32 per lane of the selecting warp
MAX_EXTRA = 32
MAX_TOP_K = 32
MAX_SLOTS = 32  # folded shared experts: one lane of the selecting warp each
BLOCK = 256  # router_logits: 8 weight rows per block
DTYPES = (mx.bfloat16, mx.float16, mx.float32)
_log = logging.getLogger(__name__)
WORKING: dict[str, bool] = {}  # "router" -> whether the kernel passed its probe in this process

_LOGITS = CudaKernel(
    name="kapitsa_router_logits",
    input_names=("x", "weight"),
    output_names=("logits",),
    source=read_cuda_source("router_logits.cu"),
    header=read_cuda_source("matvec.cuh"),  # kq2_load8
)
_SELECT = CudaKernel(
    name="kapitsa_router_select",
    input_names=("logits", "bias"),
    output_names=("inds", "weights", "extra"),
    source=read_cuda_source("router_select.cu"),
)


def route_reference(
    x: mx.array,
    weight: mx.array,
    *,
    experts: int,
    top_k: int,
    mode: str,
    bias: mx.array | None = None,
    normalize: bool = True,
    scale: float = 1.0,
    weights_dtype: mx.Dtype = mx.float32,
    shared: tuple[int, int] | None = None,
    shared_gate: bool = False,
) -> tuple[mx.array, mx.array, mx.array | None]:
    """(indices [..., k] uint32, weights [..., k] in `weights_dtype`, extra logits [..., EW - E] or
    None) in MLX ops: what Qwen's SparseMoe and Nemotron's Router compute; with `shared`, its
    experts appended to every row (k + count of each) as the models append them."""
    inds, weights, extra = _route_ops(
        x, weight, experts=experts, top_k=top_k, mode=mode, bias=bias, normalize=normalize, scale=scale,
        weights_dtype=weights_dtype,
    )  # fmt: skip
    if shared is not None:
        gate = mx.sigmoid(extra[..., :1]) if shared_gate else 1.0
        inds, weights = shared_slots(inds, weights, *shared, gate)
    return inds, weights, extra


def _route_ops(
    x: mx.array, weight: mx.array, *, experts, top_k, mode, bias, normalize, scale, weights_dtype
) -> tuple[mx.array, mx.array, mx.array | None]:
    if mode == "softmax":
        logits = x @ weight.T
        extra = logits[..., experts:] if weight.shape[0] > experts else None
        probs = mx.softmax(logits[..., :experts].astype(mx.float32), axis=-1)
        inds = topk_indices(probs, top_k)
        picked = mx.take_along_axis(probs, inds, axis=-1)
        if normalize:
            picked = picked / picked.sum(axis=-1, keepdims=True)
        return inds, (picked * scale).astype(weights_dtype), extra
    if mode != "sigmoid":
        raise ValueError(f"unknown router mode {mode!r}; one of {MODES}")
    logits = x.astype(mx.float32) @ weight.astype(mx.float32).T
    extra = logits[..., experts:].astype(x.dtype) if weight.shape[0] > experts else None
    scores = mx.sigmoid(logits[..., :experts])
    choice = scores if bias is None else scores + bias.astype(mx.float32)
    inds = topk_indices(choice, top_k)
    picked = mx.take_along_axis(scores, inds, axis=-1)
    if normalize:
        picked = picked / (picked.sum(axis=-1, keepdims=True) + 1e-20)
    return inds, (picked * scale).astype(weights_dtype), extra


def supports(
    x: mx.array,
    weight: mx.array,
    *,
    experts: int,
    top_k: int,
    bias: mx.array | None,
    shared: tuple[int, int] | None = None,
    shared_gate: bool = False,
) -> bool:
    """Whether the kernel takes this call here (CUDA, a short step, shapes within its limits)."""
    if backend() != "cuda" or x.ndim < 1 or weight.ndim != 2:
        return False
    if shared is not None and not (
        1 <= shared[1] <= MAX_SLOTS and (weight.shape[0] > experts or not shared_gate)
    ):
        return False
    k = x.shape[-1]
    return (
        1 <= math.prod(x.shape[:-1]) <= MAX_TOKENS
        and x.dtype in DTYPES
        and weight.dtype in DTYPES
        and weight.shape[1] == k
        and k % 8 == 0
        and 1 <= experts <= min(MAX_EXPERTS, weight.shape[0])
        and weight.shape[0] - experts <= MAX_EXTRA
        and 1 <= top_k <= min(MAX_TOP_K, experts)
        and (bias is None or (bias.shape == (experts,) and bias.dtype in DTYPES))
    )


@functools.cache
def _logits_template(xd, wd, k: int, rows_w: int, block: int) -> tuple:
    return (("T", xd), ("WT", wd), ("K", k), ("EW", rows_w), ("BLOCK", block))


@functools.cache
def _select_template(
    xd,
    experts: int,
    rows_w: int,
    top_k: int,
    mode: str,
    normalize: bool,
    scale: float,
    wd=mx.float32,
    shared: tuple[int, int] = (0, 0),
    shared_gate: bool = False,
) -> tuple:
    return (
        ("T", xd),
        ("WD", wd),
        ("E", experts),
        ("EW", rows_w),
        ("TOPK", top_k),
        ("MODE", MODES.index(mode)),
        ("NORM", bool(normalize)),
        ("SCALE_BITS", float_bits(scale)),
        ("SLOT0", shared[0]),
        ("SLOTS", shared[1]),
        ("GATED", bool(shared_gate)),
    )


def route_kernel(
    x: mx.array,
    weight: mx.array,
    *,
    experts: int,
    top_k: int,
    mode: str,
    bias: mx.array | None = None,
    normalize: bool = True,
    scale: float = 1.0,
    weights_dtype: mx.Dtype = mx.float32,
    shared: tuple[int, int] | None = None,
    shared_gate: bool = False,
    block: int = BLOCK,
) -> tuple[mx.array, mx.array, mx.array | None]:
    """The kernel itself (callers check `supports`); the same results as `route_reference`. The
    weights come out in `weights_dtype` (rounded as `astype` rounds), so a model that multiplies
    in its activations' dtype needs no cast after the kernel."""
    lead = x.shape[:-1]
    tokens, rows_w = math.prod(lead), weight.shape[0]
    extra_rows = rows_w - experts
    blocks_per_token = math.ceil(rows_w / (block // 32))
    width = top_k + (shared[1] if shared else 0)
    (logits,) = _LOGITS(
        [x, weight],
        template=_logits_template(x.dtype, weight.dtype, x.shape[-1], rows_w, block),
        grid=(tokens * blocks_per_token * block, 1, 1),
        threadgroup=(block, 1, 1),
        output_shapes=[(tokens, rows_w)],
        output_dtypes=[mx.float32],
    )
    inds, weights, extra = _SELECT(
        [logits, logits if bias is None else bias],  # the bias is unread in softmax mode
        template=_select_template(
            x.dtype,
            experts,
            rows_w,
            top_k,
            mode,
            normalize,
            float(scale),
            weights_dtype,
            shared or (0, 0),
            shared_gate,
        ),
        grid=(tokens * 32, 1, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[(*lead, width), (*lead, width), (*lead, max(extra_rows, 1))],
        output_dtypes=[mx.uint32, weights_dtype, x.dtype],
    )
    return inds, weights, (extra if extra_rows > 0 else None)


def route(x: mx.array, weight: mx.array, **kw) -> tuple[mx.array, mx.array, mx.array | None]:
    """The kernel where it applies and passed its probe, else the reference."""
    if WORKING.get("router") and supports(
        x, weight, experts=kw["experts"], top_k=kw["top_k"], bias=kw.get("bias"),
        shared=kw.get("shared"), shared_gate=kw.get("shared_gate", False),
    ):  # fmt: skip
        return route_kernel(x, weight, **kw)
    return route_reference(x, weight, **kw)


def plain_weight(layer) -> mx.array | None:  # noqa: ANN001 - any module
    """The weight of an unquantized, bias-free `nn.Linear` (what the kernel reads), else None."""
    return layer.weight if isinstance(layer, nn.Linear) and "bias" not in layer else None


def probe() -> bool:
    """Run the kernel's one-time check where it can apply (CUDA); idempotent."""
    if "router" not in WORKING and backend() == "cuda":
        WORKING["router"] = kernel_works()
    return WORKING.get("router", False)


def kernel_works() -> bool:
    """Whether the kernel compiles, runs and agrees with the reference on one small case of each
    mode, checked once per process (outside any compiled trace: this evaluates)."""
    keys = mx.random.split(mx.random.key(11), 3)
    x = mx.random.normal((2, 256), key=keys[0]).astype(mx.bfloat16)
    w = (0.1 * mx.random.normal((65, 256), key=keys[1])).astype(mx.bfloat16)
    bias = 0.1 * mx.random.normal((64,), key=keys[2])
    try:
        for mode, b in (("softmax", None), ("sigmoid", bias)):
            kw = dict(experts=64, top_k=4, mode=mode, bias=b, normalize=True, scale=2.5)
            got, ref = route_kernel(x, w, **kw), route_reference(x, w, **kw)
            same_experts = mx.all(mx.sort(got[0], axis=-1) == mx.sort(ref[0], axis=-1)).item()
            close = mx.allclose(
                mx.sort(got[1], axis=-1), mx.sort(ref[1], axis=-1), rtol=1e-2, atol=1e-3
            ).item()
            if not (same_experts and close):
                _log.warning("MoE router kernel disagrees with the reference (%s); not using it", mode)
                return False
    except (RuntimeError, ValueError) as exc:
        _log.warning("MoE router kernel unavailable, using the op path: %s", exc)
        return False
    return True
