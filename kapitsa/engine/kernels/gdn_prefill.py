"""The fused Gated DeltaNet kernel (gdn.py) for any number of tokens: prefill chunks and
speculative verification, not only decode.

Why: on MLX's CUDA backend the op path's recurrence (`mx.fast.gated_delta_update`) took 63.7 ms
for one Qwen3.5-27B layer at 512 tokens on the H200, the fused kernel 0.97 ms (lab/diag_h200.py,
lab/runs/decode-h200.md); with 48 such layers that was nearly all of a 27B prefill.

The kernel's token count is a compile-time constant (its loops unroll around it), so a prompt's
arbitrary chunk lengths would each cost a JIT compile. Calls past `gdn_plan.MAX_T` tokens are padded to
the next power of two instead, with the padded tokens masked out (a masked token leaves the state
untouched and yields zeros, the contract `gdn_step` shares with the reference), then sliced off:
a handful of compiles serves every prompt. The conv input is padded at its end, so no real
token's causal window sees the padding.
"""

from __future__ import annotations

import mlx.core as mx

from kapitsa.engine.kernels import gdn, gdn_plan


def padded_length(tokens: int) -> int:
    """Tokens the kernel runs for a call of `tokens`: exact up to gdn_plan.MAX_T (decode and
    verification sizes), else the next power of two."""
    if tokens <= gdn_plan.MAX_T:
        return tokens
    return 1 << (tokens - 1).bit_length()


def gdn_chain(
    conv_in: mx.array,
    conv_weight: mx.array,
    a: mx.array,
    b: mx.array,
    A_log: mx.array,
    dt_bias: mx.array,
    z: mx.array,
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
    """`gdn.gdn_step` for T tokens in a chain (no draft tree), any T: plain arrays a, b `[B, T, Hv]`,
    z `[B, T, Hv, Dv]` or `[B, T, Hv*Dv]`. Returns (out `[B, T, Hv*Dv]`, state)."""
    B, T = a.shape[:2]
    padded = padded_length(T)
    kwargs = dict(
        num_k_heads=num_k_heads,
        num_v_heads=num_v_heads,
        head_k_dim=head_k_dim,
        head_v_dim=head_v_dim,
        norm_eps=norm_eps,
    )
    inputs = (conv_in, conv_weight, a, b, A_log, dt_bias, z, norm_weight, state)
    if padded == T:
        return gdn.gdn_step(*inputs, mask=mask, **kwargs)
    if not _kernel_here(conv_in, conv_weight, state, padded, kwargs):  # not an exact-length compile
        return gdn.gdn_step_reference(*inputs, mask=mask, **kwargs)
    extra = padded - T

    def pad(x: mx.array) -> mx.array:
        return mx.pad(x, [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2))

    keep = mx.ones((B, T), mx.bool_) if mask is None else mask.astype(mx.bool_)
    out, new_state = gdn.gdn_step(
        pad(conv_in), conv_weight, pad(a), pad(b), A_log, dt_bias, pad(z), norm_weight, state,
        mask=pad(keep), **kwargs,
    )  # fmt: skip
    return out[:, :T], new_state


def _kernel_here(conv_in, conv_weight, state, tokens: int, heads: dict) -> bool:
    """Whether gdn_step would run its kernel for `tokens` tokens (padding for the reference
    would only add work)."""
    kind = gdn.backend()
    state_dtype = None if state is None else state.dtype
    dims = (heads["num_k_heads"], heads["num_v_heads"], heads["head_k_dim"], heads["head_v_dim"])
    return gdn_plan.supported(
        kind, conv_in.dtype, conv_weight.dtype, state_dtype, tokens, conv_weight.shape[1], *dims
    ) and gdn.kernel_works(kind)
