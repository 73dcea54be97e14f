"""Time kapitsa's quantized mat-vec kernels (the general one, kernels/matvec.py; the one-row one,
kernels/matvec_one_row.py; the tensor-core one, kernels/matvec_tensor_core.py) against MLX's stock
`quantized_matmul` on a Qwen3.5-27B-shaped chain of mat-vecs.

Run on the H200 (about a minute): python lab/kernels_qmv.py [--rows 1 2 4 8] [--bits 4 8]
Prints one JSON line per (bits, rows): milliseconds and weight GB/s of the whole chain for each
kernel that takes the call, its largest error against exact float32 math, and at the end the
fastest kernel per (bits, rows), to hold against `route_for` in kapitsa/engine/ops/linear.py.
--per-shape adds one line per matrix; --sweep times other launch shapes of the one-row and
tensor-core kernels (many more JIT compiles: restrict --rows/--bits).
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial

import mlx.core as mx

from kapitsa.engine.kernels import backend, matvec, matvec_one_row, matvec_tensor_core
from kapitsa.engine.kernels.matvec import qmv_reference

# (name, out_features, in_features) of one Qwen3.5-27B layer's weight mat-vecs (hidden 5120,
# intermediate 17408; Gated DeltaNet: 16 key heads x 128 for q and k, 48 value heads x 128).
SHAPES_27B = [
    ("gdn_in_qkv", 10240, 5120),
    ("gdn_in_z", 6144, 5120),
    ("gdn_out", 5120, 6144),
    ("mlp_gate", 17408, 5120),
    ("mlp_up", 17408, 5120),
    ("mlp_down", 5120, 17408),
]
# The same layer as the engine runs it after kapitsa.engine.loading.fuse: GDN in-projections (qkv, z, b,
# a) stacked, MLP gate and up stacked.
SHAPES_27B_FUSED = [
    ("gdn_in_fused", 10240 + 6144 + 48 + 48, 5120),
    ("gdn_out", 5120, 6144),
    ("mlp_gate_up", 2 * 17408, 5120),
    ("mlp_down", 5120, 17408),
]
GROUP_SIZE = 64


def _stock(x, q, s, b, bits: int) -> mx.array:
    return mx.quantized_matmul(x, q, s, b, transpose=True, group_size=GROUP_SIZE, bits=bits)


def _general(x, q, s, b, bits: int) -> mx.array:
    return matvec.qmv_general(x, q, s, b, group_size=GROUP_SIZE, bits=bits)


def _one_row(x, q, s, b, bits: int, shape=None) -> mx.array:
    return matvec_one_row.qmv_one_row(x, q, s, b, group_size=GROUP_SIZE, bits=bits, shape=shape)


def _tensor_core(x, q, s, b, bits: int, tiles: int = matvec_tensor_core.TILES) -> mx.array:
    return matvec_tensor_core.qmv_tensor_core(x, q, s, b, group_size=GROUP_SIZE, tiles=tiles)


def _reference(x, q, s, b, bits: int, **_) -> mx.array:
    return qmv_reference(x, q, s, b, group_size=GROUP_SIZE, bits=bits)


IMPLS = {"stock": _stock, "general": _general, "one_row": _one_row, "tensor_core": _tensor_core}
SUPPORTS = {
    "general": matvec.supports_general,
    "one_row": matvec_one_row.supports_one_row,
    "tensor_core": matvec_tensor_core.supports_tensor_core,
}


def _time(fn, *, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        mx.eval(fn())
    start = time.perf_counter()
    for _ in range(iters):
        mx.eval(fn())
    return (time.perf_counter() - start) / iters


def _layer(shapes: list, bits: int, shrink: int) -> list:
    """[(name, q, scales, biases, n, k)] for one layer, random weights like a trained model's."""
    layer = []
    for name, n, k in ((name, n // shrink, k // shrink) for name, n, k in shapes):
        w = mx.random.normal((n, k)).astype(mx.bfloat16) * 0.02
        q, s, b = mx.quantize(w, group_size=GROUP_SIZE, bits=bits)
        mx.eval(q, s, b)
        layer.append((name, q, s, b, n, k))
    return layer


def _chain(matvec, chain, xs, bits: int) -> list[mx.array]:
    return [matvec(xs[k], q, s, b, bits) for _, q, s, b, _, k in chain]


def _max_rel_err(impl, layer, xs, bits: int) -> float:
    """Largest |impl - exact| over the layer, relative to the largest |exact| (exact: float32
    weights s * q + b, float32 products)."""
    worst = 0.0
    for _, q, s, b, _, k in layer:
        f32 = mx.float32
        weights = mx.dequantize(q, s.astype(f32), b.astype(f32), group_size=GROUP_SIZE, bits=bits)
        ref = xs[k].astype(f32) @ weights.T
        got = impl(xs[k], q, s, b, bits).astype(f32)
        worst = max(worst, (mx.abs(got - ref).max() / mx.abs(ref).max()).item())
    return worst


def _per_shape(impls, layer, xs, bits: int, rows: int) -> None:
    for name, q, s, b, n, k in layer:
        nbytes = q.nbytes + s.nbytes + b.nbytes
        row = dict(bits=bits, rows=rows, shape=name, n=n, k=k)
        for label, impl in impls.items():
            t = _time(partial(impl, xs[k], q, s, b, bits), warmup=3, iters=50)
            row[f"{label}_us"] = round(t * 1e6, 1)
            row[f"{label}_gbs"] = round(nbytes / t / 1e9, 1)
        print(json.dumps(row), flush=True)


# Launch variants tried by --sweep: the one-row kernel's (rows per warp, warps per block, rounds
# unrolled), the tensor-core kernel's 16-row tiles per warp. Defaults: matvec_one_row.SHAPE_BY_ROWS,
# matvec_tensor_core.TILES.
SWEEP_ONE_ROW = [(2, 4, 4), (4, 4, 2), (4, 2, 2), (2, 4, 2, True)]
SWEEP_TILES = [1, 2, 4]


def _sweep(impls, chain, xs, bits: int, rows: int, total: int, iters: int) -> None:
    """Chain time of each launch variant (each one compiles its own kernels: slow, opt-in)."""
    variants = []
    if "one_row" in impls:
        variants += [("one_row", dict(shape=shape)) for shape in SWEEP_ONE_ROW]
    if "tensor_core" in impls:
        variants += [("tensor_core", dict(tiles=tiles)) for tiles in SWEEP_TILES]
    for kernel, extra in variants:
        impl = partial(impls[kernel], **extra)
        t = _time(partial(_chain, impl, chain, xs, bits), warmup=2, iters=iters)
        row = dict(bits=bits, rows=rows, kernel=kernel, **extra, ms=round(t * 1e3, 2))
        print(json.dumps({**row, "gbs": round(total / t / 1e9, 1)}), flush=True)


def _usable(xs, layer, bits: int) -> dict:
    """The kernels that take every matrix of the layer at these rows (stock always)."""
    usable = {"stock": IMPLS["stock"]}
    for label, supports in SUPPORTS.items():
        if all(supports(xs[k], q, s, b, group_size=GROUP_SIZE, bits=bits) for _, q, s, b, _, k in layer):
            usable[label] = IMPLS[label]
    return usable


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--bits", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--distinct", type=int, default=4, help="distinct layers cycled (defeats L2 reuse)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--per-shape", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also time other launch shapes (slow: compiles)")
    ap.add_argument(
        "--fused", action="store_true", help="the engine's fused projections (4 mat-vecs a layer)"
    )
    ap.add_argument("--json", default=None, help="also write every row to this file")
    ap.add_argument("--smoke", action="store_true", help="shapes / 16; kernels -> reference off CUDA")
    args = ap.parse_args()
    shrink = 16 if args.smoke else 1
    if backend() != "cuda":
        if not args.smoke:
            raise SystemExit("needs the CUDA backend (or --smoke to check the script on CPU)")
        SUPPORTS.update(dict.fromkeys(SUPPORTS, lambda *a, **kw: True))
        IMPLS.update(general=_reference, one_row=_reference, tensor_core=_reference)
    print(json.dumps(dict(mlx=mx.__version__, device=str(mx.default_device()), backend=backend())))
    results, fastest = [], {}
    for bits in args.bits:
        shapes = SHAPES_27B_FUSED if args.fused else SHAPES_27B
        layers = [_layer(shapes, bits, shrink) for _ in range(args.distinct)]
        chain = [layers[i % args.distinct][j] for i in range(args.layers) for j in range(len(shapes))]
        total = sum(q.nbytes + s.nbytes + b.nbytes for _, q, s, b, _, _ in chain)
        for rows in args.rows:
            xs = {k: mx.random.normal((rows, k)).astype(mx.bfloat16) for k in {c[5] for c in chain}}
            impls = _usable(xs, layers[0], bits)
            if args.per_shape:
                _per_shape(impls, layers[0], xs, bits, rows)
            if args.sweep:
                _sweep(impls, chain, xs, bits, rows, total, args.iters)
            name = f"{'fused ' if args.fused else ''}chain x{args.layers}"
            row = dict(bits=bits, rows=rows, shape=name, weight_gb=round(total / 1e9, 2))
            for label, impl in impls.items():
                started = time.perf_counter()
                mx.eval(_chain(impl, layers[0], xs, bits))  # JIT compiles happen here
                row[f"{label}_first_s"] = round(time.perf_counter() - started, 2)
                t = _time(partial(_chain, impl, chain, xs, bits), warmup=2, iters=args.iters)
                row[f"{label}_ms"] = round(t * 1e3, 2)
                row[f"{label}_gbs"] = round(total / t / 1e9, 1)
                row[f"{label}_max_rel_err"] = round(_max_rel_err(impl, layers[0], xs, bits), 5)
            best = min(impls, key=lambda label, r=row: r[f"{label}_ms"])
            row["fastest"] = best
            fastest.setdefault(f"{bits}-bit", {})[rows] = best
            results.append(row)
            print(json.dumps(row), flush=True)
    print(json.dumps({"fastest": fastest}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
