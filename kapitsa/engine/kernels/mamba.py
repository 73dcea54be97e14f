"""Fused Mamba-2 step for Nemotron-H: conv + SiLU, dt, the SSM update over T tokens, D skip, and
the group-gated RMS output norm, for decode (T = 1) and speculative verification (T <= 64).

Shapes: conv_in `[B, K-1+T, C]` (conv rows, then the new rows; C = H*P + 2*G*N, channels x, B, C),
conv_weight `[C, K, 1]`, conv_bias `[C]` or None, dt `[B, T, H]` (raw, before softplus),
dt_bias / A_log / D `[H]`, gate `[B, T, H*P]`, norm_weight `[H*P]`, state `[B, H, P, N]` float32
or None (zeros), mask `[B, T]` bool or None (False = padding: dt = 0 there, the state is frozen).
Returns (out `[B, T, H*P]` in gate's dtype, new state `[B, H, P, N]` float32).

Two kernels (CUDA in cuda_src/mamba_*.cu, the same algorithm for Metal in metal/mamba_step.metal):
1. step: one block per (batch row, head, slice of ROWS state rows). Per chunk of up to 16 tokens
   the block computes conv + SiLU of its x channels and of its group's B and C channels into
   shared memory; then each warp advances its 4 state rows (lanes split N with vector loads, the
   state stays in registers across all T tokens) and reduces y = S C over N by warp shuffles.
   It writes y + D x in float32.
2. norm: one block per (row, token, group): y * silu(gate), RMS over the group, times the weight.
The norm is a second kernel because a group spans H/G heads: fusing it would mean one block per
group (8 blocks for the 30B at batch 1, far too few to stream its 2 MiB of state) or a grid sync.

In Mamba2Mixer (chain forwards) one call replaces causal_conv, silu, the split, ssm_dt, ssm_scan
and self.norm; the caller still builds conv_in and the next conv rows (conv_state_after).
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from kapitsa.engine.kernels import backend, float_bits
from kapitsa.engine.kernels.cuda import CudaKernel, read_cuda_source
from kapitsa.engine.kernels.metal import read_source
from kapitsa.engine.ops.conv import causal_conv_reference
from kapitsa.engine.ops.norm import GroupGatedRMSNorm
from kapitsa.engine.ops.ssm import ssm_dt, ssm_scan_reference
from kapitsa.errors import KapitsaError

MAX_TOKENS = 64  # longer runs are prefill, where the chunked SSD scan is the better algorithm
MAX_DIM = 256  # head_dim and state_size: multiples of 32 up to this
MAX_CONV = 8
TOKEN_CHUNK = 16  # most tokens staged in shared memory at a time (bounds it for any T)
# Static shared memory a block may use: CUDA's limit without opt-in; Apple GPUs' threadgroup memory.
SHARED_LIMIT = {"cuda": 48 * 1024, "metal": 32 * 1024}
ROWS_PER_WARP = 4
NORM_THREADS = 256
DTYPES = (mx.bfloat16, mx.float16, mx.float32)
_log = logging.getLogger(__name__)
METAL_FILE = "mamba_step.metal"
METAL_NORM_MARKER = "// ---- norm body ----"


@dataclass(frozen=True)
class Dims:
    heads: int
    head_dim: int
    groups: int
    state_size: int
    time_step_limit: tuple[float, float]
    norm_eps: float

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim


def mamba_step_reference(
    conv_in, conv_weight, conv_bias, dt, dt_bias, A_log, D, gate, norm_weight, state,
    *, heads, head_dim, groups, state_size, time_step_limit, norm_eps, mask=None,
) -> tuple[mx.array, mx.array]:  # fmt: skip
    """Plain MLX ops: the model's math (Mamba2Mixer.__call__ from conv to norm), step by step."""
    B, T = dt.shape[:2]
    inner = heads * head_dim
    conv_out = causal_conv_reference(conv_in, conv_weight, conv_bias)  # [B, T, C]
    xs, Bm, Cm = mx.split(nn.silu(conv_out), [inner, inner + groups * state_size], axis=-1)
    step = ssm_dt(dt, dt_bias, time_step_limit, mask)  # [B, T, H] float32, 0 on padding
    y, new_state = ssm_scan_reference(
        xs.reshape(B, T, heads, head_dim),  # [B, T, H, P]
        step,
        A_log,
        Bm.reshape(B, T, groups, state_size),  # [B, T, G, N]
        Cm.reshape(B, T, groups, state_size),  # [B, T, G, N]
        D,
        state,
    )
    norm = GroupGatedRMSNorm(inner, norm_eps, inner // groups)
    norm.weight = norm_weight
    return norm(y.reshape(B, T, inner), gate).astype(gate.dtype), new_state


def mamba_step(
    conv_in, conv_weight, conv_bias, dt, dt_bias, A_log, D, gate, norm_weight, state,
    *, heads, head_dim, groups, state_size, time_step_limit, norm_eps, mask=None,
) -> tuple[mx.array, mx.array]:  # fmt: skip
    """`mamba_step_reference`'s result, through a kernel where `supports` says one runs."""
    dims = Dims(heads, head_dim, groups, state_size, tuple(time_step_limit), norm_eps)
    if state is None:
        state = mx.zeros((conv_in.shape[0], heads, head_dim, state_size), mx.float32)
    args = (conv_in, conv_weight, conv_bias, dt, dt_bias, A_log, D, gate, norm_weight, state)
    check_shapes(*args, dims, mask)
    if WORKING.get(backend()) is False or not supports(
        conv_in, conv_weight, head_dim=head_dim, state_size=state_size, time_step_limit=dims.time_step_limit
    ):
        return mamba_step_reference(*args, **dims.__dict__, mask=mask)
    kernels = cuda_kernels() if backend() == "cuda" else metal_kernels()
    return _launch(kernels, *args, dims, mask)


# backend -> whether the kernels agreed with the reference on `probe`'s case in this process
WORKING: dict[str, bool] = {}


def probe() -> bool:
    """Run the step and norm kernels once on a small case against the reference (once per
    process and backend): a kernel's errors surface only when a graph is evaluated, in the middle
    of a forward, so a model probes before it traces a compiled step (this evaluates). After a
    failed probe `mamba_step` keeps to the reference."""
    kind = backend()
    if kind not in ("cuda", "metal"):
        return False
    if kind not in WORKING:
        WORKING[kind] = _kernels_agree(kind)
    return WORKING[kind]


def _kernels_agree(kind: str) -> bool:
    keys = mx.random.split(mx.random.key(3), 6)  # its own keys: the global seed stays untouched
    H, P, G, N, K = 2, 32, 1, 32, 4
    C = H * P + 2 * G * N
    args = (
        mx.random.normal((1, K, C), key=keys[0]).astype(mx.bfloat16),  # K - 1 rows + 1 token
        (0.3 * mx.random.normal((C, K, 1), key=keys[1])).astype(mx.bfloat16),
        None,
        mx.random.normal((1, 1, H), key=keys[2]).astype(mx.bfloat16),
        mx.zeros((H,), mx.bfloat16),
        mx.zeros((H,), mx.float32),
        mx.ones((H,), mx.bfloat16),
        mx.random.normal((1, 1, H * P), key=keys[3]).astype(mx.bfloat16),
        mx.ones((H * P,), mx.bfloat16),
        0.1 * mx.random.normal((1, H, P, N), key=keys[4]),
    )
    dims = Dims(H, P, G, N, (0.0, math.inf), 1e-5)
    try:
        kernels = cuda_kernels() if kind == "cuda" else metal_kernels()
        got = _launch(kernels, *args, dims, None)
        ref = mamba_step_reference(*args, **dims.__dict__)
        errors = [
            float(
                mx.abs(g.astype(mx.float32) - r.astype(mx.float32)).max() / mx.abs(r.astype(mx.float32)).max()
            )
            for g, r in zip(got, ref, strict=True)
        ]
    except (RuntimeError, ValueError) as exc:
        _log.warning("Mamba-2 step kernel unavailable on %s, using the op path: %s", kind, exc)
        return False
    if not max(errors) < 3e-2:  # loose: this catches a broken kernel, not bf16 rounding
        _log.warning("Mamba-2 step kernel disagrees with the op path on %s (%s); not using it", kind, errors)
        return False
    return True


def check_shapes(
    conv_in, conv_weight, conv_bias, dt, dt_bias, A_log, D, gate, norm_weight, state, dims, mask
):
    """Raise KapitsaError naming the first argument whose shape disagrees with the others."""
    H, P, G, N = dims.heads, dims.head_dim, dims.groups, dims.state_size
    if min(H, P, G, N) <= 0 or H % G:
        raise KapitsaError(
            f"mamba_step: heads, head_dim, groups, state_size must be positive and heads a multiple "
            f"of groups, got H={H}, P={P}, G={G}, N={N}"
        )
    if conv_in.ndim != 3 or conv_weight.ndim != 3 or dt.ndim != 3:
        raise KapitsaError(
            f"mamba_step: conv_in, conv_weight and dt must be 3-D, got {conv_in.shape}, "
            f"{conv_weight.shape}, {dt.shape}"
        )
    B, T, C, K = dt.shape[0], dt.shape[1], H * P + 2 * G * N, conv_weight.shape[1]
    expected = {
        "conv_in": (conv_in, (B, K - 1 + T, C)),
        "conv_weight": (conv_weight, (C, K, 1)),
        "conv_bias": (conv_bias, (C,)),
        "dt": (dt, (B, max(T, 1), H)),
        "dt_bias": (dt_bias, (H,)),
        "A_log": (A_log, (H,)),
        "D": (D, (H,)),
        "gate": (gate, (B, T, H * P)),
        "norm_weight": (norm_weight, (H * P,)),
        "state": (state, (B, H, P, N)),
        "mask": (mask, (B, T)),
    }
    for name, (array, shape) in expected.items():
        if array is not None and tuple(array.shape) != shape:
            raise KapitsaError(
                f"mamba_step: {name} has shape {tuple(array.shape)}, expected {shape} "
                f"(B={B}, T={T}, K={K}, C={C}, H={H}, P={P}, G={G}, N={N})"
            )


def supports(
    conv_in: mx.array,
    conv_weight: mx.array,
    *,
    head_dim: int,
    state_size: int,
    time_step_limit: tuple[float, float] = (0.0, math.inf),
) -> bool:
    """Whether a kernel runs this call on this backend (otherwise `mamba_step` uses the reference)."""
    if backend() not in ("cuda", "metal") or conv_in.dtype not in DTYPES:
        return False
    K = conv_weight.shape[1]
    tokens = conv_in.shape[1] - (K - 1)
    dims_ok = all(d % 32 == 0 and 32 <= d <= MAX_DIM for d in (head_dim, state_size))
    return dims_ok and 1 <= tokens <= MAX_TOKENS and 2 <= K <= MAX_CONV and time_step_limit[1] > 0


# -- launch parameters (shared by CUDA and Metal) ------------------------------------------------


def rows_per_block(tokens: int) -> int:
    """State rows per block: 16 for short runs (more blocks at batch 1); 32 for longer ones, where
    every block recomputing its group's B/C conv for T tokens starts to cost real L2 traffic."""
    return 16 if tokens <= 4 else 32


def shared_bytes(chunk: int, rows: int, state_size: int) -> int:
    """The step kernel's shared arrays: B and C rows, x and y rows, dt and decay, per token."""
    return chunk * (2 * state_size + 2 * rows + 2) * 4


def token_chunk(tokens: int, rows: int, state_size: int, limit: int) -> int:
    """Tokens per shared-memory chunk: up to TOKEN_CHUNK, fewer where the arrays would not fit."""
    chunk = min(tokens, TOKEN_CHUNK)
    while chunk > 1 and shared_bytes(chunk, rows, state_size) > limit:
        chunk -= 1
    return chunk


def step_template(
    tokens: int, conv_kernel: int, dims: Dims, *, has_bias: bool, has_mask: bool, which: str = "cuda"
) -> list:
    rows = rows_per_block(tokens)
    lo, hi = dims.time_step_limit
    return [
        ("TOKENS", tokens),
        ("TC", token_chunk(tokens, rows, dims.state_size, SHARED_LIMIT[which])),
        ("K", conv_kernel),
        ("H", dims.heads),
        ("P", dims.head_dim),
        ("G", dims.groups),
        ("N", dims.state_size),
        ("ROWS", rows),
        ("WARPS", rows // ROWS_PER_WARP),
        ("HAS_BIAS", has_bias),
        ("HAS_MASK", has_mask),
        # softplus is > 0, so a lower limit <= 0 never binds; 0 keeps the bit pattern non-negative
        ("LO_BITS", float_bits(max(lo, 0.0))),
        ("HI_BITS", float_bits(hi)),
    ]


def norm_template(out_dtype: mx.Dtype, dims: Dims) -> list:
    return [
        ("OutT", out_dtype),
        ("INNER", dims.inner),
        ("GS", dims.inner // dims.groups),
        ("EPS_BITS", float_bits(dims.norm_eps)),
        ("THREADS", NORM_THREADS),
    ]


STEP_INPUTS = ("conv_in", "conv_w", "conv_b", "dt_raw", "dt_bias", "a_log", "d_skip", "state_in", "mask")
STEP_OUTPUTS = ("y", "state_out")
NORM_INPUTS = ("y", "gate", "norm_w")
NORM_OUTPUTS = ("out",)


@functools.cache
def _stand_in(dtype: mx.Dtype) -> mx.array:
    """One element in place of an absent optional input (no conv bias, no mask), so the kernel
    signature never changes; made once per dtype rather than once per call."""
    array = mx.zeros((1,), dtype)
    mx.eval(array)
    return array


def _launch(kernels, conv_in, conv_w, conv_b, dt, dt_bias, A_log, D, gate, norm_w, state, dims, mask):
    step_kernel, norm_kernel = kernels
    B, T = dt.shape[:2]
    H, P = dims.heads, dims.head_dim
    template = step_template(
        T, conv_w.shape[1], dims, has_bias=conv_b is not None, has_mask=mask is not None, which=backend()
    )
    rows = rows_per_block(T)
    threads = rows // ROWS_PER_WARP * 32
    conv_b = conv_b if conv_b is not None else _stand_in(conv_in.dtype)
    mask = mask.astype(mx.bool_) if mask is not None else _stand_in(mx.bool_)
    inputs = [conv_in, conv_w, conv_b, dt, dt_bias, A_log, D, state.astype(mx.float32), mask]
    y, new_state = step_kernel(
        inputs,
        template=template,
        grid=(threads * (P // rows), H, B),
        threadgroup=(threads, 1, 1),
        output_shapes=[(B, T, H * P), (B, H, P, dims.state_size)],
        output_dtypes=[mx.float32, mx.float32],
    )
    out = norm_kernel(
        [y, gate, norm_w],
        template=norm_template(gate.dtype, dims),
        grid=(NORM_THREADS * dims.groups, B * T, 1),
        threadgroup=(NORM_THREADS, 1, 1),
        output_shapes=[(B, T, H * P)],
        output_dtypes=[gate.dtype],
    )[0]
    return out, new_state


# -- kernels -------------------------------------------------------------------------------------


@functools.cache
def cuda_kernels() -> tuple[CudaKernel, CudaKernel]:
    """(step, norm): cuda_src/mamba_step.cu and mamba_norm.cu, with mamba.cuh as their header.

    Step: lane l holds, for each of its warp's RPW state rows, elements n = (j * 32 + l) * VEC + v
    (j < N / (32 VEC), v < VEC), so consecutive lanes read consecutive VEC-float vectors.
    Norm: one block per (group, row * T + token); the group's GS values are contiguous."""
    header, step, norm = (read_cuda_source(f) for f in ("mamba.cuh", "mamba_step.cu", "mamba_norm.cu"))
    return (
        CudaKernel("kapitsa_mamba_step", STEP_INPUTS, STEP_OUTPUTS, step, header),
        CudaKernel("kapitsa_mamba_norm", NORM_INPUTS, NORM_OUTPUTS, norm, header),
    )


def metal_sources() -> tuple[str, str, str]:
    """(header, step body, norm body) of metal/mamba_step.metal (two bodies, one file)."""
    header, body = read_source(METAL_FILE)
    if METAL_NORM_MARKER not in body:
        raise ValueError(f"{METAL_FILE} has no '{METAL_NORM_MARKER}' line")
    step, norm = body.split(METAL_NORM_MARKER, 1)
    return header, step, norm


@functools.cache
def metal_kernels():
    header, step, norm = metal_sources()
    step_kernel = mx.fast.metal_kernel(
        name="kapitsa_mamba_step",
        input_names=list(STEP_INPUTS),
        output_names=list(STEP_OUTPUTS),
        source=step,
        header=header,
    )
    norm_kernel = mx.fast.metal_kernel(
        name="kapitsa_mamba_norm",
        input_names=list(NORM_INPUTS),
        output_names=list(NORM_OUTPUTS),
        source=norm,
        header=header,
    )
    return _adapt(step_kernel), _adapt(norm_kernel)


def _adapt(kernel):
    """Give an mx.fast.metal_kernel the call signature of CudaKernel (sequences in, list out)."""

    def call(inputs, *, template, grid, threadgroup, output_shapes, output_dtypes):
        return kernel(
            inputs=list(inputs),
            template=list(template),
            grid=grid,
            threadgroup=threadgroup,
            output_shapes=[tuple(s) for s in output_shapes],
            output_dtypes=list(output_dtypes),
        )

    return call
