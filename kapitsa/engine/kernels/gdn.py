"""Fused Gated DeltaNet step: conv + silu, q/k L2 norm, decay/beta, the gated delta rule over T
new tokens (decode T=1, speculative verification T<=MAX_T) and the gated RMS output norm, in one
kernel launch per layer.

`gdn_step` replaces, in `GatedDeltaNet.__call__` for chains (no draft tree), everything from
`causal_conv(conv_in, ...)` to `self.norm(y, z)`:

    out, state = gdn_step(conv_in, self.conv1d.weight, a, b, self.A_log, self.dt_bias, z,
                          self.norm.weight, s0, num_k_heads=self.nk, num_v_heads=self.nv,
                          head_k_dim=self.dk, head_v_dim=self.dv, norm_eps=self.norm.eps,
                          mask=info.recurrent_mask)
    return self.out_proj(out)   # out is [B, T, Hv*Dv], already gated and normed

The caller still takes the next conv state from `conv_in` (`conv_state_after`); the kernel does
not write it. z, a and b may be `HeadView`s of the fused in-projection (`projection_views`), read
in place, so no copies precede the launch. A rollback replay is `gdn_step(..., s0, mask=m)[1]`.
Dispatch: the kernel where `gdn_plan.supports(...)` and the once-per-process `kernel_works` probe
say so, else the reference (gdn_reference.py: `gdn_step_reference`, the ops the model runs); it
never fails.

Kernel layout (cuda_src/gdn_step.cu; metal/gdn_step.metal the same): one thread block per (batch
row, value head). The state `[Dv, Dk]` (float32) lives in registers for all T tokens: each warp
owns `Dv / NW` whole rows, its lanes split Dk in coalesced float4/float2 vectors, dot products
over Dk are warp shuffles. Per chunk of tokens the block computes the head's q/k/v conv outputs
into shared memory, normalises q and k (one warp per vector), runs the recurrence (y overwrites v
in place: the warp that reads v[r] writes y[r]), then applies the output norm (one warp per
token). Roundings to the activation dtype happen where the op-by-op path rounds, so bf16 results
track the model's current path closely.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import mlx.core as mx

from kapitsa.engine.kernels import backend
from kapitsa.engine.kernels.cuda import CudaKernel, read_cuda_source
from kapitsa.engine.kernels.gdn_plan import Plan, plan_for
from kapitsa.engine.kernels.gdn_reference import HeadView, Input, gdn_step_reference
from kapitsa.engine.kernels.metal import MetalKernel

_log = logging.getLogger(__name__)
INPUT_NAMES = ("conv_in", "conv_w", "a_in", "b_in", "a_log", "dt_bias", "z", "norm_w", "state_in", "mask")
OUTPUT_NAMES = ("out", "state_out")

# cuda_src/gdn_step.cu, with its helpers in gdn_step.cuh. Template arguments: T activation dtype
# (conv/silu/q/k/v/y roundings), OT output dtype, ST dtype of `a + dt_bias`, BT dtype of beta;
# HK, HV, DK, DV heads; K conv taps; NT tokens; TC tokens per shared-memory chunk; NW warps;
# HAS_STATE, HAS_MASK; EPS_BITS the norm eps as float bits; {Z,A,B}_{ROW,OFF,GROUP,GSTRIDE} where
# z, a and b sit in their arrays (HeadView).
# How the body reads row r of the conv window: from conv_in `[B, K-1+NT, C]` here; in the decode
# variant below from the conv state `[B, K-1, C]` then the new rows, the first C columns of x_new
# (rows of X_ROW values: the fused in-projection's output read in place).
_PLAIN_WINDOW = "#define GDN_WINDOW(r, c) ((float)conv_in[((size_t)bi * (K - 1 + NT) + (r)) * C + (c)])\n"
_SPLIT_WINDOW = (
    "#define GDN_WINDOW(r, c) ((r) < K - 1 ? (float)conv_state[((size_t)bi * (K - 1) + (r)) * C + (c)]"
    " : (float)x_new[((size_t)bi * NT + (r) - (K - 1)) * X_ROW + (c)])\n"
)
CUDA_KERNEL = CudaKernel(
    "kapitsa_gdn_step",
    INPUT_NAMES,
    OUTPUT_NAMES,
    _PLAIN_WINDOW + read_cuda_source("gdn_step.cu"),
    read_cuda_source("gdn_step.cuh"),
)
# The decode variant (`gdn_decode`): no concatenated conv_in before the launch and no slice of it
# after; the kernel reads the state and the new rows where they are and writes the next state.
DECODE_INPUT_NAMES = ("conv_state", "x_new", *INPUT_NAMES[1:])
DECODE_OUTPUT_NAMES = (*OUTPUT_NAMES, "conv_out")
CUDA_DECODE_KERNEL = CudaKernel(
    "kapitsa_gdn_decode",
    DECODE_INPUT_NAMES,
    DECODE_OUTPUT_NAMES,
    _SPLIT_WINDOW + read_cuda_source("gdn_step.cu") + read_cuda_source("gdn_conv_out.cu"),
    read_cuda_source("gdn_step.cuh"),
)
METAL_KERNEL = MetalKernel("kapitsa_gdn_step", "gdn_step.metal", INPUT_NAMES, OUTPUT_NAMES)


@functools.cache
def _stand_in(dtype: mx.Dtype) -> mx.array:
    """One evaluated element, made once: a fresh `mx.zeros` per call would cost a launch."""
    x = mx.zeros((1,), dtype)
    mx.eval(x)
    return x


def gdn_step(
    conv_in: mx.array,
    conv_weight: mx.array,
    a: Input,
    b: Input,
    A_log: mx.array,
    dt_bias: mx.array,
    z: Input,
    norm_weight: mx.array,
    state: mx.array | None,
    *,
    num_k_heads: int,
    num_v_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    norm_eps: float,
    mask: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """Same contract as `gdn_step_reference`, one kernel launch where the backend has one."""
    inputs = (conv_in, conv_weight, a, b, A_log, dt_bias, z, norm_weight, state, mask)
    heads = (num_k_heads, num_v_heads, head_k_dim, head_v_dim)
    kind = backend()
    plan = plan_for(kind, inputs, heads, norm_eps)  # raises GdnShapeError on inconsistent shapes
    if plan is None or not kernel_works(kind):
        return gdn_step_reference(
            *inputs[:9],
            num_k_heads=num_k_heads,
            num_v_heads=num_v_heads,
            head_k_dim=head_k_dim,
            head_v_dim=head_v_dim,
            norm_eps=norm_eps,
            mask=mask,
        )
    return run_kernel(kind, plan, inputs)


def _kernel_arrays(inputs: tuple) -> list[mx.array]:
    """`gdn_step`'s inputs as the kernel takes them: views as their arrays, and a one-element
    stand-in for an absent state or mask (one signature; HAS_* skip reading them)."""
    conv_in, conv_weight, a, b, A_log, dt_bias, z, norm_weight, state, mask = inputs
    if mask is not None and mask.dtype != mx.bool_:
        mask = mask.astype(mx.bool_)
    return [
        conv_in,
        conv_weight,
        _array(a),
        _array(b),
        A_log,
        dt_bias,
        _array(z),
        norm_weight,
        state if state is not None else _stand_in(mx.float32),
        mask if mask is not None else _stand_in(mx.bool_),
    ]


def run_kernel(kind: str, plan: Plan, inputs: tuple) -> tuple[mx.array, mx.array]:
    """Launch the backend's kernel on `gdn_step`'s inputs (a planned, supported call)."""
    kernel = CUDA_KERNEL if kind == "cuda" else METAL_KERNEL
    out, new_state = kernel(
        _kernel_arrays(inputs),
        template=plan.template,
        grid=plan.grid,
        threadgroup=plan.threadgroup,
        output_shapes=plan.output_shapes,
        output_dtypes=plan.output_dtypes,
    )
    return out, new_state


def _array(x: Input) -> mx.array:
    return x.array if isinstance(x, HeadView) else x


def _probe_inputs(T: int, seed: int) -> tuple:
    """`gdn_step`'s inputs (no mask) for the kernels' one-time checks: one key head, two value
    heads of 128, a conv of 4 taps; their own random keys, so the global seed stays untouched."""
    keys = mx.random.split(mx.random.key(seed), 5)
    hk, hv, d = 1, 2, 128
    C = 2 * hk * d + hv * d
    return (
        mx.random.normal((1, 3 + T, C), key=keys[0]),
        0.5 * mx.random.normal((C, 4, 1), key=keys[1]),
        mx.random.normal((1, T, hv), key=keys[2]),
        mx.random.normal((1, T, hv), key=keys[3]),
        mx.zeros((hv,)),
        mx.zeros((hv,)),
        mx.ones((1, T, hv, d)),
        mx.ones((d,)),
        0.1 * mx.random.normal((1, hv, d, d), key=keys[4]),
    )


_PROBE_HEADS = dict(num_k_heads=1, num_v_heads=2, head_k_dim=128, head_v_dim=128)


def _agrees(kind: str, what: str, compare) -> bool:
    """Run `compare()` -> (kernel outputs, reference outputs), or None when there is no kernel for
    the case; whether every output is within a loose 1e-2 of the reference (this catches a broken
    kernel, not rounding). Failures are logged and answer False."""
    try:
        pair = compare()
        if pair is None:
            return False
        errors = [float(mx.abs(g - r).max() / mx.abs(r).max()) for g, r in zip(*pair, strict=True)]
    except (RuntimeError, ValueError) as exc:
        _log.warning("%s unavailable on %s, using the op path: %s", what, kind, exc)
        return False
    if not max(errors) < 1e-2:
        _log.warning("%s disagrees with the op path on %s (%s); not using it", what, kind, errors)
        return False
    return True


@functools.cache
def kernel_works(kind: str) -> bool:
    """Whether this backend's kernel compiles, runs and roughly agrees with the reference on one
    small case, checked once per process: a kernel's errors surface only at evaluation, in the
    middle of a forward, and `gdn_step` must never fail. Otherwise it keeps to the reference."""
    inputs = (*_probe_inputs(2, seed=0), mx.array([[True, False]]))
    heads = tuple(_PROBE_HEADS.values())

    def compare():
        plan = plan_for(kind, inputs, heads, 1e-6)
        if plan is None:
            return None
        ref = gdn_step_reference(*inputs[:9], **_PROBE_HEADS, norm_eps=1e-6, mask=inputs[9])
        return run_kernel(kind, plan, inputs), ref

    return _agrees(kind, "fused GDN step kernel", compare)


@dataclass(frozen=True)
class _Window:
    """The shape and dtype of the conv window `[B, K-1+T, C]` that `gdn_decode` never builds, for
    the planner (which reads only `.shape` and `.dtype` of conv_in)."""

    shape: tuple[int, int, int]
    dtype: mx.Dtype


def gdn_decode(
    conv_state: mx.array,
    x_new: mx.array,
    conv_weight: mx.array,
    a: Input,
    b: Input,
    A_log: mx.array,
    dt_bias: mx.array,
    z: Input,
    norm_weight: mx.array,
    state: mx.array | None,
    *,
    num_k_heads: int,
    num_v_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    norm_eps: float,
    fused: bool = True,
) -> tuple[mx.array, mx.array, mx.array]:
    """`gdn_step` on `concatenate([conv_state, x_new[..., :C]], axis=1)`, also returning the next
    conv state (the window's last K-1 rows): (out, conv state, state). x_new `[B, T, N]`, N >= C:
    its first C columns are the new conv rows (Qwen3.5's fused in-projection output as it is).

    On CUDA one launch reads the conv state and x_new in place and writes the next conv state,
    so the concatenation and the two slices around it are not primitives of the step. `fused`
    False: the op-by-op path (`gdn_step_reference`) on the concatenated window, no kernel."""
    C, K = conv_weight.shape[0], conv_weight.shape[1]
    B, T = x_new.shape[:2]
    heads = dict(
        num_k_heads=num_k_heads, num_v_heads=num_v_heads, head_k_dim=head_k_dim, head_v_dim=head_v_dim
    )
    kind = backend()
    if (
        fused
        and kind == "cuda"
        and x_new.ndim == 3
        and x_new.shape[-1] >= C
        and conv_state.shape == (B, K - 1, C)
        and conv_state.dtype == x_new.dtype
    ):
        window = _Window((B, K - 1 + T, C), x_new.dtype)
        inputs = (window, conv_weight, a, b, A_log, dt_bias, z, norm_weight, state, None)
        plan = plan_for(kind, inputs, tuple(heads.values()), norm_eps)
        if plan is not None and decode_kernel_works(kind):
            return _run_decode(plan, conv_state, x_new, inputs[1:])
    new_rows = x_new if x_new.shape[-1] == C else x_new[..., :C]
    conv_in = mx.concatenate([conv_state, new_rows], axis=1)
    step = gdn_step if fused else gdn_step_reference
    out, new_state = step(
        conv_in, conv_weight, a, b, A_log, dt_bias, z, norm_weight, state, **heads, norm_eps=norm_eps
    )
    return out, conv_in[:, T:], new_state


def _run_decode(plan: Plan, conv_state: mx.array, x_new: mx.array, rest: tuple) -> tuple[mx.array, ...]:
    """Launch the decode variant; `rest` is `gdn_step`'s inputs after conv_in."""
    B, K1, C = conv_state.shape
    out, new_state, conv_out = CUDA_DECODE_KERNEL(
        [conv_state, x_new, *_kernel_arrays((None, *rest))[1:]],
        template=(*plan.template, ("X_ROW", x_new.shape[-1]), ("CT", conv_state.dtype)),
        grid=plan.grid,
        threadgroup=plan.threadgroup,
        output_shapes=(*plan.output_shapes, (B, K1, C)),
        output_dtypes=(*plan.output_dtypes, conv_state.dtype),
    )
    return out, conv_out, new_state


def probe() -> None:
    """Run the kernels' one-time checks where they apply (CUDA). They evaluate, so a model calls
    this before tracing a decode step that may launch them."""
    if backend() == "cuda":
        decode_kernel_works("cuda")


@functools.cache
def decode_kernel_works(kind: str) -> bool:
    """Whether the decode variant compiles, runs and agrees with the concatenating path on one
    small case (x_new wider than the conv channels, as the fused projection is); once per process."""
    if not kernel_works(kind):
        return False
    conv_in, *rest = _probe_inputs(1, seed=1)
    conv_state, rows = conv_in[:, :3], conv_in[:, 3:]
    x_new = mx.concatenate([rows, mx.ones((1, 1, 40))], axis=-1)

    def compare():
        window = _Window(conv_in.shape, conv_in.dtype)
        plan = plan_for(kind, (window, *rest, None), tuple(_PROBE_HEADS.values()), 1e-6)
        if plan is None:
            return None
        out, state = gdn_step_reference(conv_in, *rest, **_PROBE_HEADS, norm_eps=1e-6)
        return _run_decode(plan, conv_state, x_new, (*rest, None)), (out, conv_in[:, 1:], state)

    return _agrees(kind, "GDN decode kernel", compare)
