"""An attention layer's q, k, v (and output gate) for a decode step, in one CUDA kernel.

Between the fused q/k/v projection and the KV cache, a Qwen3.5 attention layer's decode step is
a split, reshapes and transposes, the per-head q and k RMSNorms and the two rotations: on MLX's
CUDA backend about 30 primitives per attention layer, each ~3-8 us of host time
(lab/host_costs.py), where the linear-attention layers take 7 in all (lab/graph_census.py).
Here it is one kernel (cuda_src/attn_prep.cu) reading the projection's output as it is, for up
to PREP_MAX_TOKENS tokens per row (decode steps and short verification chains).
`prep_reference` is the same computation in MLX ops, written from the definitions
(`mx.fast.rms_norm`, ops/rope.py `rope_reference`); tests check it against the model's
`Attention.project` + `rotate`.

In kernel family "attn" with the decode attention (kernels/attention.py), used only after
`probe()` passed (the engine's ModelRunner runs it when the family is on).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import mlx.core as mx

from kapitsa.engine.kernels import backend, float_bits
from kapitsa.engine.kernels.cuda import CudaKernel, read_cuda_source
from kapitsa.engine.ops.rope import rope_reference

MAX_TOKENS = 16  # a decode step or a short verification chain (models/base.py CHAIN_MAX_T)
MAX_HEAD_DIM = 256
WARPS = 4
DTYPES = (mx.bfloat16, mx.float16, mx.float32)
WORKING: dict[tuple, bool] = {}  # (PrepSpec, dtype) -> whether the kernel passed its probe for that layout
_log = logging.getLogger(__name__)

_KERNEL = CudaKernel(
    name="kapitsa_attn_prep",
    input_names=("qkv", "q_w", "k_w", "inv_freq", "offsets"),
    output_names=("q", "k", "v", "gate"),
    source=read_cuda_source("attn_prep.cu"),
)


@dataclass(frozen=True)
class PrepSpec:
    """The layout of one attention layer's fused projection and what is done to its heads."""

    heads: int
    kv_heads: int
    head_dim: int
    gated: bool  # each query head's D values are followed by its D gate values
    eps: float | None  # the q/k RMSNorms' epsilon; None: no norms
    rotary_dims: int  # features rotated per head (the first ones); 0: no rotation

    @property
    def width(self) -> int:
        """The fused projection's output features."""
        return self.heads * self.head_dim * (2 if self.gated else 1) + 2 * self.kv_heads * self.head_dim


def supports(tokens: int, dtype: mx.Dtype, spec: PrepSpec) -> bool:
    """Whether the kernel takes a fused projection's output `[B, tokens, spec.width]` of `dtype`."""
    return (
        backend() == "cuda"
        and 1 <= tokens <= MAX_TOKENS
        and dtype in DTYPES
        and spec.head_dim % 32 == 0
        and spec.head_dim <= MAX_HEAD_DIM
        and spec.rotary_dims % 2 == 0
        and 0 <= spec.rotary_dims <= spec.head_dim
    )


def usable(tokens: int, dtype: mx.Dtype, spec: PrepSpec) -> bool:
    """`supports` and the probe passed for this layout and dtype."""
    return WORKING.get((spec, dtype), False) and supports(tokens, dtype, spec)


GENERIC = PrepSpec(heads=4, kv_heads=2, head_dim=64, gated=True, eps=1e-6, rotary_dims=16)


def _probe_case(spec: PrepSpec, dtype: mx.Dtype) -> tuple:
    keys = mx.random.split(mx.random.key(9), 4)  # its own keys: the global seed stays untouched
    D = spec.head_dim
    qkv = mx.random.normal((2, 2, spec.width), key=keys[0]).astype(dtype)
    q_w = (1 + 0.2 * mx.random.normal((D,), key=keys[1])).astype(dtype)
    k_w = (1 + 0.2 * mx.random.normal((D,), key=keys[2])).astype(dtype)
    dims = spec.rotary_dims or 2
    inv_freq = 1.0 / (10000.0 ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims))
    return qkv, mx.array([3, 70], dtype=mx.int32), spec, q_w, k_w, inv_freq


def probe(spec: PrepSpec = GENERIC, dtype: mx.Dtype = mx.bfloat16) -> bool:
    """Run the kernel once for this layout and dtype against the reference where it can apply
    (CUDA); idempotent. A layer probes its own layout before tracing (models/base.py), so each
    kernel variant a model uses has run once. Call it outside any compiled trace: it evaluates."""
    key = (spec, dtype)
    if key in WORKING or backend() != "cuda" or not supports(2, dtype, spec):
        return WORKING.get(key, False)
    case = _probe_case(spec, dtype)
    try:
        got, ref = prep(*case), prep_reference(*case)
        WORKING[key] = all(
            r is None or mx.allclose(g.astype(mx.float32), r.astype(mx.float32), atol=3e-2, rtol=3e-2).item()
            for g, r in zip(got, ref, strict=True)
        )
    except (RuntimeError, ValueError) as exc:
        _log.warning("attention prep kernel unavailable for %s, using the op path: %s", spec, exc)
        WORKING[key] = False
    if not WORKING[key]:
        _log.warning("attention prep kernel disagrees with the reference for %s; using the op path", spec)
    return WORKING[key]


@functools.cache
def _template(dtype, spec: PrepSpec) -> tuple:
    """Rows and tokens are not template arguments: the kernel reads them from qkv's shape."""
    return (
        ("T", dtype),
        ("D", spec.head_dim),
        ("HQ", spec.heads),
        ("HKV", spec.kv_heads),
        ("R", spec.rotary_dims),
        ("GATED", spec.gated),
        ("NORM", spec.eps is not None),
        ("EPS_BITS", float_bits(spec.eps or 0.0)),
        ("WARPS", WARPS),
    )


def _row_offsets(offsets: mx.array | int, rows: int) -> mx.array:
    if isinstance(offsets, int):
        return mx.full((rows,), offsets, dtype=mx.int32)
    if offsets.shape == (rows,) and offsets.dtype == mx.int32:
        return offsets  # the step's own offsets array: no primitive for a no-op reshape
    return mx.broadcast_to(offsets.astype(mx.int32).reshape(-1), (rows,))


def prep(
    qkv: mx.array,
    offsets: mx.array | int,
    spec: PrepSpec,
    q_w: mx.array | None,
    k_w: mx.array | None,
    inv_freq: mx.array | None,
) -> tuple[mx.array, mx.array, mx.array, mx.array | None]:
    """q `[B, H, T, D]` and k `[B, Hkv, T, D]` (normed, rotated at `offsets[b] + t`), v
    `[B, Hkv, T, D]` and the gate `[B, T, H * D]` (None when not gated), in qkv's dtype, from qkv
    `[B, T, spec.width]`. Callers check `supports`."""
    B, T, _ = qkv.shape
    H, Hkv, D = spec.heads, spec.kv_heads, spec.head_dim
    tasks = B * T * (H + 2 * Hkv)
    unused = qkv  # inputs a template leaves unread still need an array
    q, k, v, gate = _KERNEL(
        [
            qkv,
            unused if q_w is None else q_w,
            unused if k_w is None else k_w,
            unused if inv_freq is None else inv_freq,
            _row_offsets(offsets, B),
        ],
        template=_template(qkv.dtype, spec),
        grid=(-(-tasks // WARPS) * WARPS * 32, 1, 1),
        threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(B, H, T, D), (B, Hkv, T, D), (B, Hkv, T, D), (B, T, H * D) if spec.gated else (1,)],
        output_dtypes=[qkv.dtype] * 4,
    )
    return q, k, v, gate if spec.gated else None


def prep_reference(
    qkv: mx.array,
    offsets: mx.array | int,
    spec: PrepSpec,
    q_w: mx.array | None,
    k_w: mx.array | None,
    inv_freq: mx.array | None,
) -> tuple[mx.array, mx.array, mx.array, mx.array | None]:
    """What `prep` computes, in MLX ops."""
    B, T, _ = qkv.shape
    H, Hkv, D = spec.heads, spec.kv_heads, spec.head_dim
    q_width = H * D * (2 if spec.gated else 1)
    q, k, v = mx.split(qkv, [q_width, q_width + Hkv * D], axis=-1)
    q = q.reshape(B, T, H, -1)
    gate = None
    if spec.gated:
        q, gate = mx.split(q, 2, axis=-1)
        gate = gate.reshape(B, T, H * D)
    k = k.reshape(B, T, Hkv, D)
    if spec.eps is not None:
        q, k = mx.fast.rms_norm(q, q_w, spec.eps), mx.fast.rms_norm(k, k_w, spec.eps)
    q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
    if spec.rotary_dims:
        rows = _row_offsets(offsets, B)
        q = rope_reference(q, spec.rotary_dims, inv_freq, rows)
        k = rope_reference(k, spec.rotary_dims, inv_freq, rows)
    return q, k, v.reshape(B, T, Hkv, D).transpose(0, 2, 1, 3), gate
