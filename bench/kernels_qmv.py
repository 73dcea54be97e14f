"""Time kapitsa's quantized mat-vec kernel against MLX's stock `quantized_matmul` on real shapes.

Run on a CUDA (or Metal) machine: python bench/kernels_qmv.py [--rows 1 8] [--layers 64]
Prints per-shape and whole-chain times and achieved weight bandwidth.
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial

import mlx.core as mx

from kapitsa.engine.kernels import backend
from kapitsa.engine.kernels.qmv import qmv

# (name, out_features, in_features) per layer of a Qwen3.5-27B-shaped model (hidden 5120,
# intermediate 17408, GDN 16 k-heads / 48 v-heads x 128).
SHAPES_27B = [
    ("gdn_in_qkv", 10240, 5120),
    ("gdn_in_z", 6144, 5120),
    ("gdn_out", 5120, 6144),
    ("mlp_gate", 17408, 5120),
    ("mlp_up", 17408, 5120),
    ("mlp_down", 5120, 17408),
]


def _time(fn, *, warmup: int = 3, iters: int = 20) -> float:
    for _ in range(warmup):
        mx.eval(fn())
    start = time.perf_counter()
    for _ in range(iters):
        mx.eval(fn())
    return (time.perf_counter() - start) / iters


def _stock(x, q, s, b, gs: int, bits: int) -> mx.array:
    return mx.quantized_matmul(x, q, s, b, transpose=True, group_size=gs, bits=bits)


def _ours(x, q, s, b, gs: int, bits: int) -> mx.array:
    return qmv(x, q, s, b, group_size=gs, bits=bits)


def _chain(matvec, chain, xs, gs: int, bits: int) -> list[mx.array]:
    return [matvec(xs[k], q, s, b, gs, bits) for _, q, s, b, _, k in chain]


def _make(n: int, k: int, bits: int, gs: int):
    w = mx.random.normal((n, k)).astype(mx.bfloat16) * 0.02
    q, s, b = mx.quantize(w, group_size=gs, bits=bits)
    mx.eval(q, s, b)
    return q, s, b


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--bits", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    print(f"mlx {mx.__version__} device {mx.default_device()} backend {backend()}")
    results = []
    for bits in args.bits:
        gs = 64
        layer = [(name, *_make(n, k, bits, gs), n, k) for name, n, k in SHAPES_27B]
        for rows in args.rows:
            for name, q, s, b, n, k in layer:
                x = mx.random.normal((rows, k)).astype(mx.bfloat16)
                nbytes = q.nbytes + s.nbytes + b.nbytes
                t_stock = _time(partial(_stock, x, q, s, b, gs, bits))
                t_ours = _time(partial(_ours, x, q, s, b, gs, bits))
                ref = mx.quantized_matmul(x, q, s, b, transpose=True, group_size=gs, bits=bits).astype(
                    mx.float32
                )
                err = float(mx.abs(qmv(x, q, s, b, group_size=gs, bits=bits).astype(mx.float32) - ref).max())
                row = dict(
                    bits=bits,
                    rows=rows,
                    shape=name,
                    n=n,
                    k=k,
                    stock_us=t_stock * 1e6,
                    ours_us=t_ours * 1e6,
                    stock_gbs=nbytes / t_stock / 1e9,
                    ours_gbs=nbytes / t_ours / 1e9,
                    max_abs_err=err,
                )
                results.append(row)
                print(json.dumps(row))
            # A whole model's worth of mat-vecs evaluated as one graph (launch overhead amortised).
            chain = layer * args.layers
            xs = {k: mx.random.normal((rows, k)).astype(mx.bfloat16) for k in {c[5] for c in layer}}
            total = sum(q.nbytes + s.nbytes + b.nbytes for _, q, s, b, _, _ in layer) * args.layers
            t_stock = _time(partial(_chain, _stock, chain, xs, gs, bits), iters=5)
            t_ours = _time(partial(_chain, _ours, chain, xs, gs, bits), iters=5)
            row = dict(
                bits=bits,
                rows=rows,
                shape=f"chain x{args.layers}",
                weight_gb=total / 1e9,
                stock_ms=t_stock * 1e3,
                ours_ms=t_ours * 1e3,
                stock_gbs=total / t_stock / 1e9,
                ours_gbs=total / t_ours / 1e9,
            )
            results.append(row)
            print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
