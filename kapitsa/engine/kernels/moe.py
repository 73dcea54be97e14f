"""Routed MoE experts for few tokens (decode, speculative verify): y[m] = sum_j s[m,j] E_{i[m,j]}(x[m]).

Two kernels (CUDA: cuda_src/moe_hidden.cu and moe_out.cu; the same algorithm in metal/moe.metal),
each reading a routed expert's quantized weights once for every (token, slot) pair routed to it:
  1. `hidden`: h[p] = act(W1[e_p] x[token(p)]) for every pair p, the activation fused (SwiGLU:
     silu(gate) * up, or relu^2), float32. Grid (row blocks, pairs): the block of the first pair
     routed to an expert computes that expert's rows for all the tokens routed to it; the blocks of
     later pairs with the same expert exit at once.
  2. `out`: y[m, d] = sum_j s[m,j] dot(W2[e_j][d], h[m,j]). A block owns output rows d for every
     token and walks the distinct experts, so the weighted sum over slots needs no atomics and no
     separate reduction op.
One warp per weight row (lanes split short rows), 16-byte weight loads, several in flight per lane,
activations staged once per block in shared memory as float (padded rows: no bank conflicts).
Weights are MLX affine (`mx.quantize` along the input axis, stacked [E, out, in/pack]), 4 or 8 bits.
Larger batches (prefill) keep `mx.gather_qmm`, which sorts pairs by expert and runs a real matmul.
The kernels' launch plans and objects are in moe_launch.py.
"""

from __future__ import annotations

import mlx.core as mx

from kapitsa.engine.kernels import backend
from kapitsa.engine.kernels.moe_launch import (
    KINDS,
    MAX_PAIRS,
    MAX_TOKENS,
    Plan,
    QuantStack,
    capacity_for,
    run_cuda,
    run_metal,
)
from kapitsa.engine.ops.moe import QuantizedSwitchLinear, SwitchGLU, SwitchReluSquared
from kapitsa.errors import KapitsaError

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
ACT_DTYPES = (mx.bfloat16, mx.float16, mx.float32)
INDEX_DTYPES = (mx.int32, mx.uint32)


def stacks_of(first, kind: str) -> tuple[QuantStack, ...]:
    """`first` as a tuple of stacks: (gate, up) for SwiGLU, (fc1,) for relu^2."""
    if kind not in KINDS:
        raise KapitsaError(f"experts_decode: kind must be one of {KINDS}, got {kind!r}")
    single = len(first) == 3 and all(isinstance(a, mx.array) for a in first)
    stacks = (QuantStack(*first),) if single else tuple(QuantStack(*s) for s in first)
    want = 2 if kind == "swiglu" else 1
    if len(stacks) != want:
        names = "(gate, up)" if want == 2 else "(fc1,)"
        raise KapitsaError(f"experts_decode: kind {kind!r} takes first = {names} stacks, got {len(stacks)}")
    return stacks


def _dims(stack: QuantStack, bits: int, group_size: int, name: str) -> tuple[int, int, int]:
    """(experts, out, in) of a stack, checking that its weight, scales and biases agree."""
    if stack.weight.ndim != 3 or stack.weight.dtype != mx.uint32:
        raise KapitsaError(
            f"experts_decode: {name} weight must be uint32 [E, out, in*bits/32], "
            f"got {stack.weight.dtype} {stack.weight.shape}"
        )
    n_exp, n_out, packed = stack.weight.shape
    n_in = packed * 32 // bits
    want = (n_exp, n_out, n_in // group_size)
    for part in ("scales", "biases"):
        arr = getattr(stack, part)
        if arr is None or tuple(arr.shape) != want or n_in % group_size:
            got = None if arr is None else tuple(arr.shape)
            raise KapitsaError(
                f"experts_decode: {name} {part} must be {want} (affine, bits {bits}, group {group_size}), "
                f"got {got}"
            )
    return n_exp, n_out, n_in


def check_shapes(x, indices, scores, first, second, *, kind, group_size, bits) -> tuple[int, int, int, int]:
    """Raise KapitsaError on inconsistent arguments; return (experts, hidden, in_dims, out_dims)."""
    if bits not in BITS or group_size not in GROUP_SIZES:
        raise KapitsaError(
            f"experts_decode: affine bits {BITS}, groups {GROUP_SIZES}; got bits {bits}, group {group_size}"
        )
    stacks = stacks_of(first, kind)
    if x.ndim < 1 or indices.ndim < 1 or indices.shape[:-1] != x.shape[:-1] or scores.shape != indices.shape:
        raise KapitsaError(
            "experts_decode: need x [..., D], indices and scores [..., k] with the same leading shape; "
            f"got x {x.shape}, indices {indices.shape}, scores {scores.shape}"
        )
    dims = {_dims(s, bits, group_size, n) for s, n in zip(stacks, ("first", "up"), strict=False)}
    if len(dims) != 1:
        raise KapitsaError(f"experts_decode: gate and up stacks differ in shape: {sorted(dims)}")
    n_exp, hidden, n_in = dims.pop()
    e2, n_out, h2 = _dims(QuantStack(*second), bits, group_size, "second")
    if n_in != x.shape[-1] or e2 != n_exp or h2 != hidden:
        raise KapitsaError(
            f"experts_decode: x has {x.shape[-1]} features, first is [E={n_exp}, {hidden}, {n_in}], "
            f"second is [E={e2}, {n_out}, {h2}]; need first [E, H, D] and second [E, D_out, H]"
        )
    return n_exp, hidden, n_in, n_out


def _gather(x: mx.array, stack: QuantStack, indices: mx.array, group_size: int, bits: int) -> mx.array:
    return mx.gather_qmm(x, *stack, rhs_indices=indices, transpose=True, group_size=group_size, bits=bits)


def experts_decode_reference(x, indices, scores, first, second, *, kind, group_size, bits) -> mx.array:
    """What SwitchGLU / SwitchReluSquared (unsorted gather path), the score weighting and the sum
    over slots compute today. x [..., D], indices/scores [..., k] -> [..., D_out] in x's dtype."""
    check_shapes(x, indices, scores, first, second, kind=kind, group_size=group_size, bits=bits)
    stacks = stacks_of(first, kind)
    rows = mx.expand_dims(x, (-2, -3))  # [..., 1, 1, D]: one row per slot, gathered by expert
    if kind == "swiglu":
        gate, up = (_gather(rows, s, indices, group_size, bits) for s in stacks)
        h = gate * mx.sigmoid(gate) * up
    else:
        h = mx.square(mx.maximum(_gather(rows, stacks[0], indices, group_size, bits), 0))
    y = _gather(h, QuantStack(*second), indices, group_size, bits).squeeze(-2)  # [..., k, D_out]
    return (y * scores[..., None]).sum(axis=-2).astype(x.dtype)


def supports(
    x: mx.array,
    indices: mx.array,
    *,
    group_size: int,
    bits: int,
    scales_dtype=None,
    max_pairs: int = MAX_PAIRS,
) -> bool:
    """Whether the decode kernels run this call: a GPU backend, affine 4/8-bit, and few tokens and
    (token, expert) pairs (<= MAX_TOKENS, <= min(max_pairs, MAX_PAIRS)); anything else keeps the
    reference path."""
    if backend() not in ("cuda", "metal") or x.ndim < 1 or indices.ndim < 1:
        return False
    k = indices.shape[-1]
    tokens = indices.size // k if k else 0
    return (
        x.dtype in ACT_DTYPES
        and (scales_dtype is None or scales_dtype in ACT_DTYPES)
        and indices.dtype in INDEX_DTYPES
        and bits in BITS
        and group_size in GROUP_SIZES
        and 1 <= tokens <= MAX_TOKENS
        and 1 <= tokens * k <= min(max_pairs, MAX_PAIRS)
    )


def experts_decode(x, indices, scores, first, second, *, kind, group_size, bits) -> mx.array:
    """Routed experts, weighted by `scores` and summed over the k slots.

    x [..., D]; indices [..., k] int32/uint32; scores [..., k] (any float dtype: the product is
    taken in float32); `first` = (gate, up) stacks [E, H, D/pack] for kind "swiglu", the fc1 stack
    for "relu2"; `second` = down / fc2 stack [E, D_out, H/pack]. Returns [..., D_out] in x's dtype.
    Runs the kernels where `supports`, else `experts_decode_reference`."""
    n_exp, hidden, n_in, n_out = check_shapes(
        x, indices, scores, first, second, kind=kind, group_size=group_size, bits=bits
    )
    stacks = stacks_of(first, kind)
    second = QuantStack(*second)
    if not supports(x, indices, group_size=group_size, bits=bits, scales_dtype=second.scales.dtype):
        return experts_decode_reference(
            x, indices, scores, first, second, kind=kind, group_size=group_size, bits=bits
        )
    return _decode(x, indices, scores, stacks, second, (n_exp, hidden, n_out), kind, group_size, bits)


def _decode(
    x,
    indices,
    scores,
    stacks,
    second,
    dims,
    kind: str,
    group_size: int,
    bits: int,
    max_pairs: int = MAX_PAIRS,
) -> mx.array:
    """The kernel path for arguments already checked."""
    n_exp, hidden, n_out = dims
    n_in, k = x.shape[-1], indices.shape[-1]
    tokens = indices.size // k
    on_cuda = backend() == "cuda"
    capacity = capacity_for(tokens, k, max_pairs) if on_cuda else 0
    plan = Plan(tokens, k, n_exp, n_in, hidden, n_out, bits, group_size, kind, capacity)
    if on_cuda:
        return run_cuda(plan, x, _token_rows(indices, tokens), scores, stacks, second)
    flat = (x.reshape(tokens, n_in), indices.reshape(tokens, k), scores.reshape(tokens, k))
    return run_metal(plan, *flat, stacks, second).reshape(*x.shape[:-1], n_out)


def _token_rows(indices: mx.array, tokens: int) -> mx.array:
    """`indices` with one row per token, as the CUDA kernels count tokens (`indices_shape[0]`):
    a decode step's [streams, 1, k] already is one (each primitive costs the host a few us a
    step, a reshape included); a verify's [1, T, k] is reshaped."""
    if indices.ndim >= 2 and indices.shape[0] == tokens:
        return indices
    return indices.reshape(tokens, indices.shape[-1])


def _layers(switch_mlp) -> tuple[str, tuple] | None:
    # Item access, not attributes: nn.Module's attribute lookup costs ~3 us a name on the host.
    if isinstance(switch_mlp, SwitchGLU):
        return "swiglu", (switch_mlp["gate_proj"], switch_mlp["up_proj"], switch_mlp["down_proj"])
    if isinstance(switch_mlp, SwitchReluSquared):
        return "relu2", (switch_mlp["fc1"], switch_mlp["fc2"])
    return None


def _read_stacks(kind: str, layers: tuple):
    if not all(
        isinstance(q, QuantizedSwitchLinear) and q.mode == "affine" and "bias" not in q and "biases" in q
        for q in layers
    ):
        return None
    formats = {(q.group_size, q.bits) for q in layers}
    if len(formats) != 1:
        return None
    stacks = tuple(QuantStack(q["weight"], q["scales"], q["biases"]) for q in layers)
    group_size, bits = formats.pop()
    try:  # a module that does not fit the kernels' shapes and formats keeps its own path
        dims = check_shapes(
            mx.zeros((1, layers[0]["weight"].shape[-1] * 32 // bits)),
            mx.zeros((1, 1), mx.uint32),
            mx.zeros((1, 1)),
            stacks[:-1],
            stacks[-1],
            kind=kind,
            group_size=group_size,
            bits=bits,
        )
    except KapitsaError:
        return None
    return kind, stacks[:-1], stacks[-1], group_size, bits, dims


_CACHE_ATTR = "_kapitsa_moe_stacks"


def module_stacks(switch_mlp) -> tuple[str, tuple[QuantStack, ...], QuantStack, int, int] | None:
    """(kind, first, second, group_size, bits) of a quantized SwitchGLU / SwitchReluSquared whose
    layers the kernels can read (affine, one format, no linear bias); None otherwise."""
    found = _module_info(switch_mlp)
    return None if found is None else found[:5]


def _module_info(switch_mlp):
    """module_stacks plus (experts, hidden, in, out), cached on the module until its arrays change
    (the key is the identity of every weight array, so loading new weights re-reads them)."""
    found = _layers(switch_mlp)
    if found is None:
        return None
    kind, layers = found
    key = tuple(id(dict.get(q, name)) for q in layers for name in ("weight", "scales", "biases"))
    cached = switch_mlp.__dict__.get(_CACHE_ATTR)
    if cached is None or cached[0] != key:
        cached = (key, _read_stacks(kind, layers))
        object.__setattr__(switch_mlp, _CACHE_ATTR, cached)
    return cached[1]


def routed_experts(
    switch_mlp, x: mx.array, indices: mx.array, scores: mx.array, max_pairs: int = MAX_PAIRS
) -> mx.array:
    """Drop-in for `(switch_mlp(x, indices) * scores[..., None]).sum(axis=-2).astype(x.dtype)`:
    the decode kernels when the module's format and the call's size allow (at most `max_pairs`
    token-expert pairs: KernelOptions.moe_max_pairs), else exactly that."""
    found = _module_info(switch_mlp)
    if found is not None:
        kind, first, second, group_size, bits, (n_exp, hidden, n_in, n_out) = found
        scales_dtype = second.scales.dtype
        if supports(
            x, indices, group_size=group_size, bits=bits, scales_dtype=scales_dtype, max_pairs=max_pairs
        ):
            if x.shape[-1] != n_in or indices.shape[:-1] != x.shape[:-1] or scores.shape != indices.shape:
                check_shapes(x, indices, scores, first, second, kind=kind, group_size=group_size, bits=bits)
            dims = (n_exp, hidden, n_out)
            return _decode(x, indices, scores, first, second, dims, kind, group_size, bits, max_pairs)
    return (switch_mlp(x, indices) * scores[..., None]).sum(axis=-2).astype(x.dtype)
