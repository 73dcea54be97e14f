"""Launch plans and kernel objects of the routed-experts decode kernels (moe.py): the token
capacity a compile serves, staged tiles under the shared-memory budget, grids, and the CUDA kernels
(cuda_src/moe_hidden.cu, moe_out.cu) with their Metal port (metal/moe.metal)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import mlx.core as mx

from kapitsa.engine.kernels.cuda import CudaKernel, read_cuda_source
from kapitsa.engine.kernels.metal import read_source
from kapitsa.engine.options import MOE_KERNEL_PAIRS

KINDS = ("swiglu", "relu2")
MAX_TOKENS = 16
# Token-expert pairs the kernels hold at most (an 8-token verify of a top-8 MoE with its shared
# expert folded in, moe_fold.py); a model's layers take them up to KernelOptions.moe_max_pairs.
MAX_PAIRS = MOE_KERNEL_PAIRS


class QuantStack(NamedTuple):
    """One projection of every expert: the `mx.quantize` output of a [E, out, in] weight."""

    weight: mx.array  # [E, out, in * bits / 32] uint32
    scales: mx.array  # [E, out, in / group_size]
    biases: mx.array  # [E, out, in / group_size]


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


def capacity_for(tokens: int, k: int, max_pairs: int = MAX_PAIRS) -> int:
    """The compiled token capacity for `tokens` tokens of k slots: the next power of two (a new
    decode batch size or chain length then rarely compiles anything: NVRTC takes about a second a
    kernel on the H200, and MLX keeps custom kernels in memory only), `tokens` itself where the
    power of two's pairs would pass `max_pairs`, the most the caller routes here (the shared
    arrays grow as pairs x tokens and shrink the staged tiles)."""
    power = 1 << (tokens - 1).bit_length()
    return power if power <= MAX_TOKENS and power * k <= min(max_pairs, MAX_PAIRS) else tokens


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


def run_cuda(plan: Plan, x, indices, scores, stacks: tuple[QuantStack, ...], second: QuantStack):
    """The two kernels on x `[..., n_in]` and scores `[..., k]` as they come (the kernels read
    them as contiguous rows of tokens), indices with one row per token; y `[..., n_out]`."""
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
        output_shapes=[(*x.shape[:-1], plan.n_out)],
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


def run_metal(plan: Plan, x, indices, scores, stacks: tuple[QuantStack, ...], second: QuantStack):
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
