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
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import mlx.core as mx

from kapitsa.engine.kernels import backend
from kapitsa.engine.kernels.cuda import CudaKernel, read_cuda_source
from kapitsa.engine.kernels.metal import read_source
from kapitsa.engine.ops.moe import QuantizedSwitchLinear, SwitchGLU, SwitchReluSquared
from kapitsa.errors import KapitsaError

KINDS = ("swiglu", "relu2")
BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
MAX_TOKENS = 16
# Token-expert pairs above which gather_qmm's sorted matmul is the better path: an 8-token verify
# of a top-8 MoE with its shared expert folded in (moe_fold.py) is 72 pairs but only 65 distinct
# experts at most, each still read once.
MAX_PAIRS = 72
ACT_DTYPES = (mx.bfloat16, mx.float16, mx.float32)
INDEX_DTYPES = (mx.int32, mx.uint32)


class QuantStack(NamedTuple):
    """One projection of every expert: the `mx.quantize` output of a [E, out, in] weight."""

    weight: mx.array  # [E, out, in * bits / 32] uint32
    scales: mx.array  # [E, out, in / group_size]
    biases: mx.array  # [E, out, in / group_size]


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


def supports(x: mx.array, indices: mx.array, *, group_size: int, bits: int, scales_dtype=None) -> bool:
    """Whether the decode kernels run this call: a GPU backend, affine 4/8-bit, and few tokens and
    (token, expert) pairs (<= MAX_TOKENS, <= MAX_PAIRS); anything else keeps the reference path."""
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
        and 1 <= tokens * k <= MAX_PAIRS
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


def _decode(x, indices, scores, stacks, second, dims, kind: str, group_size: int, bits: int) -> mx.array:
    """The kernel path for arguments already checked."""
    n_exp, hidden, n_out = dims
    n_in, k = x.shape[-1], indices.shape[-1]
    tokens = indices.size // k
    on_cuda = backend() == "cuda"
    capacity = capacity_for(tokens, k) if on_cuda else 0
    plan = Plan(tokens, k, n_exp, n_in, hidden, n_out, bits, group_size, kind, capacity)
    flat = (x.reshape(tokens, n_in), indices.reshape(tokens, k), scores.reshape(tokens, k))
    run = _run_cuda if on_cuda else _run_metal
    return run(plan, *flat, stacks, second).reshape(*x.shape[:-1], n_out)


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


def routed_experts(switch_mlp, x: mx.array, indices: mx.array, scores: mx.array) -> mx.array:
    """Drop-in for `(switch_mlp(x, indices) * scores[..., None]).sum(axis=-2).astype(x.dtype)`:
    the decode kernels when the module's format and the call's size allow, else exactly that."""
    found = _module_info(switch_mlp)
    if found is not None:
        kind, first, second, group_size, bits, (n_exp, hidden, n_in, n_out) = found
        if supports(x, indices, group_size=group_size, bits=bits, scales_dtype=second.scales.dtype):
            if x.shape[-1] != n_in or indices.shape[:-1] != x.shape[:-1] or scores.shape != indices.shape:
                check_shapes(x, indices, scores, first, second, kind=kind, group_size=group_size, bits=bits)
            return _decode(x, indices, scores, first, second, (n_exp, hidden, n_out), kind, group_size, bits)
    return (switch_mlp(x, indices) * scores[..., None]).sum(axis=-2).astype(x.dtype)


# ----------------------------------------------------------------------------------------------
# Launch geometry (shared by the CUDA and Metal paths)

WARPS = 8  # warps per block (the output kernel drops to 4 or 2 to spread few rows over more SMs)
MIN_BLOCKS = 132  # one block per SM of an H200: fewer leave SMs without loads in flight
SHARED_BUDGET = 44 * 1024  # static + dynamic shared memory per block: under the 48 KiB default


def values_per_chunk(bits: int) -> int:
    """Weights in one 16-byte load."""
    return 128 // bits


def lanes_per_row(chunks: int) -> int:
    """Lanes sharing one weight row: 32, or fewer (a power of two) when the row has fewer chunks."""
    lanes = 32
    while lanes > 1 and lanes > chunks:
        lanes //= 2
    return lanes


def tile_for(length: int, staged_rows: int, bits: int, budget: int) -> int:
    """Values per staged tile: a multiple of 32 whose padded float tile for `staged_rows` rows fits
    `budget` bytes, the length split into equal tiles (no short last tile idling most lanes)."""
    vpc = values_per_chunk(bits)
    per_value = staged_rows * 4 * (vpc + 1) / vpc
    largest = max(32, int(budget / per_value) // 32 * 32)
    tiles = -(-length // largest)
    return -(-length // tiles // 32) * 32 if tiles > 1 else -(-length // 32) * 32


def capacity_for(tokens: int, k: int) -> int:
    """The compiled token capacity for `tokens` tokens of k slots: the next power of two (a new
    decode batch size or chain length then rarely compiles anything: NVRTC takes about a second a
    kernel on the H200, and MLX keeps custom kernels in memory only), `tokens` itself where the
    power of two's pairs would pass MAX_PAIRS (its shared arrays grow as pairs x tokens)."""
    power = 1 << (tokens - 1).bit_length()
    return power if power <= MAX_TOKENS and power * k <= MAX_PAIRS else tokens


@dataclass(frozen=True)
class Plan:
    tokens: int
    k: int
    experts: int
    n_in: int
    hidden: int
    n_out: int
    bits: int
    group_size: int
    kind: str
    # Tokens the compiled kernels hold room for (the template's M); the CUDA kernels read the real
    # count from the indices' shape, so a capacity serves every count up to it (`capacity_for`).
    # 0: exactly `tokens` (the Metal port takes the count from its template).
    capacity: int = 0

    @property
    def pairs(self) -> int:
        return self.tokens * self.k

    @property
    def rows(self) -> int:
        """Tokens the kernels are compiled and their shared memory sized for."""
        return self.capacity or self.tokens

    @property
    def hidden_static_bytes(self) -> int:
        return 3 * 4 * self.rows + 16

    @property
    def out_static_bytes(self) -> int:
        pairs = self.rows * self.k
        return 3 * 4 * pairs + 2 * 4 * pairs * self.rows + 16

    def hidden_template(self, x_dtype, s_dtype, i_dtype, budget: int = SHARED_BUDGET) -> list:
        tile = tile_for(self.n_in, self.rows, self.bits, budget - self.hidden_static_bytes)
        nw = 2 if self.kind == "swiglu" else 1
        return [
            ("T", x_dtype), ("S", s_dtype), ("I", i_dtype),
            ("M", self.rows), ("K", self.k), ("E", self.experts), ("D", self.n_in), ("N", self.hidden),
            ("GS", self.group_size), ("BITS", self.bits), ("NW", nw), ("KIND", KINDS.index(self.kind)),
            ("LPR", lanes_per_row(tile // values_per_chunk(self.bits))), ("WARPS", WARPS),
            ("TILE", tile), ("U", 4 // nw),
        ]  # fmt: skip

    def out_template(self, y_dtype, s_dtype, i_dtype, sc_dtype, budget: int = SHARED_BUDGET) -> list:
        tile = tile_for(self.hidden, self.rows * self.k, self.bits, budget - self.out_static_bytes)
        lanes = lanes_per_row(tile // values_per_chunk(self.bits))
        rows_per_warp = 32 // lanes
        warps = next((w for w in (8, 4) if -(-self.n_out // (w * rows_per_warp)) >= MIN_BLOCKS), 2)
        return [
            ("T", y_dtype), ("S", s_dtype), ("I", i_dtype), ("SC", sc_dtype),
            ("M", self.rows), ("K", self.k), ("E", self.experts), ("D", self.hidden), ("N", self.n_out),
            ("GS", self.group_size), ("BITS", self.bits), ("LPR", lanes), ("WARPS", warps),
            ("TILE", tile), ("U", 4),
        ]  # fmt: skip

    def blocks(self, rows: int, template: list) -> int:
        t = dict(template)
        rows_per_block = t["WARPS"] * (32 // t["LPR"])
        return (rows + rows_per_block - 1) // rows_per_block

    def shared_bytes(self, template: list, staged_rows: int) -> int:
        t = dict(template)
        vpc = values_per_chunk(self.bits)
        return staged_rows * (t["TILE"] // vpc) * (vpc + 1) * 4


# ----------------------------------------------------------------------------------------------
# CUDA: cuda_src/moe_hidden.cu and moe_out.cu, both with moe.cuh as their header.

# Kernel 1. Template: T (x), S (scales), I (indices), M tokens, K slots, E experts, D inputs,
# N hidden rows, GS, BITS, NW weight stacks (2: gate, up), KIND (0 swiglu, 1 relu2), LPR lanes per
# row, WARPS, TILE staged x values, U chunks in flight per lane and stack. Its WEIGHT_POINTERS line
# becomes one of these (the stacks as arrays the loops index):
_POINTERS = {
    1: "const uint32_t* wp[1] = {w0}; const S* sp[1] = {s0}; const S* bp[1] = {b0};",
    2: "const uint32_t* wp[2] = {w0, w1}; const S* sp[2] = {s0, s1}; const S* bp[2] = {b0, b1};",
}


@functools.cache
def hidden_kernel(kind: str) -> CudaKernel:
    nw = 2 if kind == "swiglu" else 1
    weights = tuple(f"{p}{s}" for s in range(nw) for p in ("w", "s", "b"))
    return CudaKernel(
        name=f"kapitsa_moe_hidden_{kind}",
        input_names=("x", "indices", *weights),
        output_names=("h",),
        source=read_cuda_source("moe_hidden.cu").replace("WEIGHT_POINTERS", _POINTERS[nw]),
        header=read_cuda_source("moe.cuh"),
    )


# Kernel 2. Template: T (y), S, I, SC (scores), M, K, E, D hidden (input of this projection),
# N output rows, GS, BITS, LPR, WARPS, TILE staged h values, U chunks in flight per lane.
OUT_KERNEL = CudaKernel(
    name="kapitsa_moe_out",
    input_names=("h", "indices", "scores", "w", "scales", "biases"),
    output_names=("y",),
    source=read_cuda_source("moe_out.cu"),
    header=read_cuda_source("moe.cuh"),
)


class Launch(NamedTuple):
    hidden_template: list
    hidden_grid: tuple[int, int, int]  # in threads, as MLX takes it
    hidden_threads: tuple[int, int, int]
    hidden_shared: int
    out_template: list
    out_grid: tuple[int, int, int]
    out_threads: tuple[int, int, int]
    out_shared: int


@functools.cache
def launch_for(plan: Plan, x_dtype, s1_dtype, s2_dtype, i_dtype, sc_dtype, budget: int) -> Launch:
    """Template values, grids (in threads) and dynamic shared memory of both kernels."""
    t1 = plan.hidden_template(x_dtype, s1_dtype, i_dtype, budget=budget)
    t2 = plan.out_template(x_dtype, s2_dtype, i_dtype, sc_dtype, budget=budget)
    threads1, threads2 = dict(t1)["WARPS"] * 32, dict(t2)["WARPS"] * 32
    return Launch(
        t1,
        (plan.blocks(plan.hidden, t1) * threads1, plan.pairs, 1),
        (threads1, 1, 1),
        plan.shared_bytes(t1, plan.rows),
        t2,
        (plan.blocks(plan.n_out, t2) * threads2, 1, 1),
        (threads2, 1, 1),
        plan.shared_bytes(t2, plan.rows * plan.k),
    )


def _as(a: mx.array, dtype) -> mx.array:
    return a if a.dtype == dtype else a.astype(dtype)


def _kernel_inputs(stacks: tuple[QuantStack, ...], second: QuantStack) -> tuple[list, list]:
    """Weight inputs of both kernels, scales and biases of a kernel in one dtype."""
    s1, s2 = stacks[0].scales.dtype, second.scales.dtype
    first = [a for st in stacks for a in (st.weight, _as(st.scales, s1), _as(st.biases, s1))]
    return first, [second.weight, second.scales, _as(second.biases, s2)]


def _run_cuda(plan: Plan, x, indices, scores, stacks: tuple[QuantStack, ...], second: QuantStack):
    geo = launch_for(
        plan, x.dtype, stacks[0].scales.dtype, second.scales.dtype, indices.dtype, scores.dtype, SHARED_BUDGET
    )
    first_w, second_w = _kernel_inputs(stacks, second)
    h = hidden_kernel(plan.kind)(
        [x, indices, *first_w],
        template=geo.hidden_template,
        grid=geo.hidden_grid,
        threadgroup=geo.hidden_threads,
        output_shapes=[(plan.pairs, plan.hidden)],
        output_dtypes=[mx.float32],
        shared_memory=geo.hidden_shared,
    )[0]
    return OUT_KERNEL(
        [h, indices, scores, *second_w],
        template=geo.out_template,
        grid=geo.out_grid,
        threadgroup=geo.out_threads,
        output_shapes=[(plan.tokens, plan.n_out)],
        output_dtypes=[x.dtype],
        shared_memory=geo.out_shared,
    )[0]


# ----------------------------------------------------------------------------------------------
# Metal: metal/moe.metal holds both bodies (hidden after "---- body ----", out after
# "---- out body ----"); threadgroup memory is 32 KiB there, so tiles are planned smaller.

METAL_BUDGET = 28 * 1024
OUT_BODY_MARKER = "// ---- out body ----"
_METAL_POINTERS = {
    1: "const device uint32_t* wp[1] = {w0}; const device S* sp[1] = {s0}; const device S* bp[1] = {b0};",
    2: "const device uint32_t* wp[2] = {w0, w1}; const device S* sp[2] = {s0, s1}; "
    "const device S* bp[2] = {b0, b1};",
}


@functools.cache
def metal_kernels(kind: str):
    """(hidden, out) kernels from metal/moe.metal, called like CudaKernel (no shared_memory)."""
    header, bodies = read_source("moe.metal")
    hidden_body, out_body = bodies.split(OUT_BODY_MARKER, 1)
    nw = 2 if kind == "swiglu" else 1
    hidden = mx.fast.metal_kernel(
        name=f"kapitsa_moe_hidden_{kind}",
        input_names=list(hidden_kernel(kind).input_names),
        output_names=["h"],
        source=hidden_body.replace("WEIGHT_POINTERS", _METAL_POINTERS[nw]),
        header=header,
    )
    out = mx.fast.metal_kernel(
        name="kapitsa_moe_out",
        input_names=list(OUT_KERNEL.input_names),
        output_names=["y"],
        source=out_body,
        header=header,
    )
    return hidden, out


def _run_metal(plan: Plan, x, indices, scores, stacks: tuple[QuantStack, ...], second: QuantStack):
    hidden, out = metal_kernels(plan.kind)
    geo = launch_for(
        plan, x.dtype, stacks[0].scales.dtype, second.scales.dtype, indices.dtype, scores.dtype, METAL_BUDGET
    )
    first_w, second_w = _kernel_inputs(stacks, second)
    h = hidden(
        inputs=[x, indices, *first_w],
        template=geo.hidden_template,
        grid=geo.hidden_grid,
        threadgroup=geo.hidden_threads,
        output_shapes=[(plan.pairs, plan.hidden)],
        output_dtypes=[mx.float32],
    )[0]
    return out(
        inputs=[h, indices, scores, *second_w],
        template=geo.out_template,
        grid=geo.out_grid,
        threadgroup=geo.out_threads,
        output_shapes=[(plan.tokens, plan.n_out)],
        output_dtypes=[x.dtype],
    )[0]
