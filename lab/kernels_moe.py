"""Time the MoE decode kernels against the gather_qmm reference and the models' module path.

Run on a CUDA (or Metal) machine: python lab/kernels_moe.py [--tokens 1 8] [--bits 4]
Prints one JSON line per (shape, tokens): microseconds per call for the kernels
(`experts_decode`), the reference (`experts_decode_reference`: unsorted gather_qmm) and the module
(SwitchGLU / SwitchReluSquared + weighting + sum, which sorts pairs by expert from 64 pairs up),
plus the routed weight bytes read per call and the kernels' effective bandwidth. Each call is
evaluated on its own (`*_us`: launch and sync included, as a lone call pays them) and, with
`--chain N` (default 8), N calls over N different routings evaluated as one graph
(`*_chained_us`: the device time a call costs inside a decode step; different experts each call so
the weights come from memory, not from the previous call's L2 lines).
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx
import numpy as np

from kapitsa.engine.kernels import backend
from kapitsa.engine.kernels.moe import experts_decode, experts_decode_reference, module_stacks, supports
from kapitsa.engine.ops.moe import QuantizedSwitchLinear, SwitchGLU, SwitchReluSquared

# name: (kind, experts, k, in dims, hidden, out dims)
SHAPES = {
    "qwen3.5-35b-a3b": ("swiglu", 256, 8, 2048, 512, 2048),
    "nemotron-3-nano-30b-a3b": ("relu2", 128, 6, 2688, 1856, 2688),
}


def _time_us(fn, iters: int) -> float:
    for _ in range(5):
        mx.eval(fn())
    start = time.perf_counter()
    for _ in range(iters):
        mx.eval(fn())
    return (time.perf_counter() - start) / iters * 1e6


def _chained_us(fn, routings: list, iters: int) -> float:
    """Microseconds per call of `fn(idx, scores)` when `len(routings)` calls run as one graph."""
    for _ in range(3):
        mx.eval([fn(*r) for r in routings])
    start = time.perf_counter()
    for _ in range(iters):
        mx.eval([fn(*r) for r in routings])
    return (time.perf_counter() - start) / (iters * len(routings)) * 1e6


def _module(kind: str, experts: int, d: int, hidden: int, bits: int):
    module = SwitchGLU(d, hidden, experts) if kind == "swiglu" else SwitchReluSquared(d, hidden, experts)
    for name, child in module.children().items():
        setattr(module, name, QuantizedSwitchLinear.from_switch_linear(child, 64, bits, "affine"))
    module.set_dtype(mx.bfloat16)
    mx.eval(module.parameters())
    return module


def _routing(tokens: int, k: int, experts: int, rng: np.random.Generator):
    idx = np.stack([rng.choice(experts, size=k, replace=False) for _ in range(tokens)]).astype(np.uint32)
    scores = rng.random((tokens, k)).astype(np.float32)
    return mx.array(idx), mx.array(scores / scores.sum(-1, keepdims=True)).astype(mx.bfloat16)


def _measure(module, found, x, idx, scores, iters: int, chain: list) -> dict:
    kind, first, second, gs, bits = found
    args = dict(kind=kind, group_size=gs, bits=bits)

    def kernel(i, s):
        return experts_decode(x, i, s, first, second, **args)

    def reference(i, s):
        return experts_decode_reference(x, i, s, first, second, **args)

    def via_module(i, s):
        return (module(x, i) * s[..., None]).sum(axis=-2)

    t_kernel = _time_us(lambda: kernel(idx, scores), iters)
    t_ref = _time_us(lambda: reference(idx, scores), iters)
    t_module = _time_us(lambda: via_module(idx, scores), iters)
    want = reference(idx, scores).astype(mx.float32)
    got = kernel(idx, scores).astype(mx.float32)
    row = dict(
        kernel_used=supports(x, idx, group_size=gs, bits=bits),
        kernel_us=round(t_kernel, 1),
        reference_us=round(t_ref, 1),
        module_us=round(t_module, 1),
        speedup_vs_module=round(t_module / t_kernel, 2),
        max_rel_err=float(mx.abs(got - want).max()) / max(float(mx.abs(want).max()), 1e-6),
    )
    if chain:
        rounds = max(1, iters // len(chain))
        row.update(
            kernel_chained_us=round(_chained_us(kernel, chain, rounds), 1),
            module_chained_us=round(_chained_us(via_module, chain, rounds), 1),
        )
    return row


def bench_shape(name: str, bits: int, token_counts: list[int], iters: int, chain: int = 0) -> list[dict]:
    kind, experts, k, d, hidden, _ = SHAPES[name]
    module = _module(kind, experts, d, hidden, bits)
    found = module_stacks(module)
    per_expert = sum(a.nbytes for s in (*found[1], found[2]) for a in s) / experts
    rng = np.random.default_rng(0)
    rows = []
    for tokens in token_counts:
        x = mx.random.normal((tokens, d)).astype(mx.bfloat16)
        idx, scores = _routing(tokens, k, experts, rng)
        routings = [_routing(tokens, k, experts, rng) for _ in range(chain)]
        timing = _measure(module, found, x, idx, scores, iters, routings)
        weight_bytes = per_expert * len(set(np.array(idx).reshape(-1).tolist()))  # distinct experts read
        row = dict(shape=name, kind=kind, bits=bits, tokens=tokens, pairs=tokens * k, **timing)
        row.update(
            weight_mb=round(weight_bytes / 1e6, 2), kernel_gbs=round(weight_bytes / row["kernel_us"] / 1e3, 1)
        )
        if chain:  # the same count of distinct experts, on average, as the lone call's routing
            row["kernel_chained_gbs"] = round(weight_bytes / row["kernel_chained_us"] / 1e3, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--bits", type=int, nargs="+", default=[4])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--chain", type=int, default=8, help="calls per graph in the chained timing (0: off)")
    args = ap.parse_args()
    print(json.dumps(dict(mlx=mx.__version__, device=str(mx.default_device()), backend=backend())))
    for bits in args.bits:
        for name in args.shapes:
            bench_shape(name, bits, args.tokens, args.iters, args.chain)


if __name__ == "__main__":
    main()
