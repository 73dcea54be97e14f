"""What a decode step costs the host on a GPU backend, per primitive, in one short run (JSON lines).

- `micro`: host microseconds per primitive (building the graph in Python, then `mx.async_eval`
  encoding it) for chains of one kind of primitive: a tiny custom kernel whose source is short or
  padded (MLX hashes a custom kernel's whole source at every launch), an uncompiled elementwise
  op, a compiled chain of custom kernels, a one-row stock `quantized_matmul`.
- per shape: kapitsa's decode step as the engine runs it (fused, routed), and mlx-lm's: build /
  encode / wait milliseconds (lab/decode_profile.py) and a histogram of the step's primitives
  (from `mx.export_to_dot` of the unevaluated step), so the launch count per token is known.

Run on the H200: python lab/host_costs.py [--shapes 4b nemotron-30b-a3b] [--skip micro qmv]
- `qmv`: the 27B's one-row mat-vec chain through the one-row kernel (kernels/matvec_one_row.py)
  at several launch shapes.

CPU smoke run: python lab/host_costs.py --tiny --shapes 4b --skip micro
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import re
import tempfile
import time

import mlx.core as mx

from kapitsa.engine.kernels.cuda import CudaKernel
from kapitsa.engine.runner.model_runner import ModelRunner
from kapitsa.testing.tiny import tiny_config
from lab.decode_profile import _kapitsa_step, _mlxlm_step, _profile
from lab.engine_timing import DEFAULTS
from lab.models_under_test import DTYPE, SHAPES, TINY, kapitsa_model, mlxlm_model

CHAIN = 400  # primitives per timed chain


def _emit(row: dict) -> None:
    print(json.dumps(row), flush=True)


def _per_op_us(build, n: int = CHAIN, reps: int = 5) -> dict:
    """Median host microseconds per primitive to build and to encode a chain from `build()`."""
    mx.eval(build())  # JIT, allocations
    builds, encodes, totals = [], [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = build()
        t1 = time.perf_counter()
        mx.async_eval(out)
        t2 = time.perf_counter()
        mx.eval(out)
        t3 = time.perf_counter()
        builds.append(t1 - t0)
        encodes.append(t2 - t1)
        totals.append(t3 - t0)
    med = lambda xs: sorted(xs)[len(xs) // 2] * 1e6 / n  # noqa: E731
    return dict(
        build_us=round(med(builds), 2), encode_us=round(med(encodes), 2), total_us=round(med(totals), 2)
    )


def _probe_kernel(pad: int) -> CudaKernel:
    return CudaKernel(
        name=f"kapitsa_host_probe_{pad}",
        input_names=("a",),
        output_names=("b",),
        source="  if (threadIdx.x == 0) b[0] = a[0] + 1.0f;\n",
        header="// " + "x" * pad + "\n" if pad else "",
    )


def micro() -> None:
    x = mx.zeros((1,), dtype=mx.float32)
    mx.eval(x)
    for pad in (0, 4000, 16000):
        kernel = _probe_kernel(pad)

        def launch(y, kernel=kernel):
            return kernel(
                [y],
                template=[],
                grid=(32, 1, 1),
                threadgroup=(32, 1, 1),
                output_shapes=[(1,)],
                output_dtypes=[mx.float32],
            )[0]

        def chain(y, launch=launch):
            for _ in range(CHAIN):
                y = launch(y)
            return y

        _emit(dict(kind="micro", op=f"custom_kernel_src+{pad}", **_per_op_us(lambda chain=chain: chain(x))))
        traced = mx.compile(chain)
        _emit(dict(kind="micro", op=f"compiled_custom_kernel_src+{pad}", **_per_op_us(lambda t=traced: t(x))))

    def adds(y):
        for _ in range(CHAIN):
            y = y + 1.0
        return y

    _emit(dict(kind="micro", op="add_uncompiled", **_per_op_us(lambda: adds(x))))
    w = mx.random.normal((256, 512)).astype(mx.bfloat16)
    q, s, b = mx.quantize(w, group_size=64, bits=4)
    v = mx.random.normal((1, 512)).astype(mx.bfloat16)
    mx.eval(q, s, b, v)

    def qmms():
        return [mx.quantized_matmul(v, q, s, b, transpose=True, group_size=64, bits=4) for _ in range(CHAIN)]

    _emit(dict(kind="micro", op="quantized_matmul_1row", **_per_op_us(qmms)))


def primitive_histogram(out: mx.array) -> collections.Counter:
    """Primitive name -> count in the unevaluated graph behind `out`."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "g.dot")
        mx.export_to_dot(path, out)
        with open(path) as f:
            return collections.Counter(re.findall(r'label ="([^"]+)"', f.read()))


def _summarise(hist: collections.Counter) -> dict:
    compiled = sum(n for name, n in hist.items() if name.startswith("Compiled"))
    rest = {name: n for name, n in hist.items() if not name.startswith("Compiled")}
    return dict(
        primitives=sum(hist.values()),
        compiled_fusions=compiled,
        others=dict(sorted(rest.items(), key=lambda kv: -kv[1])),
    )


def shape_costs(name: str, table: dict, prompt_len: int, steps: int, engines=("kapitsa", "mlx-lm")) -> None:
    kind, dims = table[name]
    config = tiny_config(kind, **dims)
    vocab = dims.get("vocab_size", 512)
    prompt = [(i * 7919) % (vocab - 10) + 5 for i in range(prompt_len)]
    for engine in engines:
        if engine == "kapitsa":
            model = kapitsa_model(config)
            # fuses projections and routes quantized linears, as the engine does, under the
            # KAPITSA_* kernel options of this process's environment (engine_timing.DEFAULTS)
            ModelRunner(model, kernels=DEFAULTS)
            prefill, step = _kapitsa_step(model)
        else:
            model = mlxlm_model(config)
            prefill, step = _mlxlm_step(model)
        for _ in range(2):  # the first pass compiles
            result = _profile(prefill, step, prompt, steps)
        logits = prefill(prompt)
        tok = mx.argmax(logits, axis=-1)[:, None].astype(mx.int32)
        mx.eval(tok)
        hist = primitive_histogram(mx.argmax(step(tok), axis=-1))
        setting = (
            {k: v for k, v in os.environ.items() if k.startswith("KAPITSA_")} if engine == "kapitsa" else {}
        )
        _emit(dict(kind="step", shape=name, engine=engine, **setting, **result, **_summarise(hist)))
        del model, prefill, step
        gc.collect()
        mx.clear_cache()


# (rows per warp, warps per block, rounds unrolled) of the one-row kernel to time
# (a fourth element True: the loop over round groups unrolled, so loads may overlap the math).
# Fewer warps per block make the blocks finer, so the last wave's tail is shorter (nine shapes at
# 4 and 8 warps: lab/runs/qmv-h200-s7.log).
# the last three: persistent grids of 528, 660 and 792 blocks (4-6 per SM of the H200's 132 at the
# kernel's 80-90 registers), each warp looping over its share of the row groups
ONE_ROW_SHAPES = [
    (4, 4, 2),
    (4, 2, 2),
    (4, 1, 2),
    (2, 4, 2, True),
    (4, 4, 2, False, 528),
    (4, 4, 2, False, 660),
    (4, 4, 2, False, 792),
]


def _fused_extras(x: mx.array, q: mx.array) -> dict:
    """A norm prologue and, where the output is no wider than x, a residual epilogue (x's own
    values stand in for the norm weight and the residual: the cost is what is timed)."""
    n = q.shape[0]
    return dict(norm=(x[0], 1e-6), residual=x[..., :n] if x.shape[-1] >= n else None)


def qmv_sweep() -> None:
    """The 27B's fused one-row mat-vec chain (lab/diag_h200.py) through stock, a read-only
    kernel and the one-row kernel at each of ONE_ROW_SHAPES: ms, GB/s, error against stock."""
    from kapitsa.engine.kernels import matvec_one_row as one_row
    from lab.diag_h200 import FUSED_27B, GS, read_only, timed

    layers = []
    for _ in range(4):
        layer = []
        for n, k in FUSED_27B:
            q, s, b = mx.quantize(mx.random.normal((n, k)).astype(mx.bfloat16) * 0.02, group_size=GS, bits=4)
            mx.eval(q, s, b)
            layer.append((q, s, b, k))
        layers.append(layer)
    chain = [layers[i % 4][j] for i in range(64) for j in range(4)]
    nbytes = sum(q.nbytes + s.nbytes + b.nbytes for q, s, b, _ in chain)
    xs = {k: mx.random.normal((1, k)).astype(mx.bfloat16) for k in {c[3] for c in chain}}
    impls = {
        "stock": lambda x, q, s, b: mx.quantized_matmul(x, q, s, b, transpose=True, group_size=GS, bits=4),
        "read_only": lambda x, q, s, b: read_only(q),
    }
    for shape in ONE_ROW_SHAPES:
        impls[f"one_row{shape}"] = lambda x, q, s, b, shape=shape: one_row.qmv_one_row(
            x, q, s, b, group_size=GS, bits=4, shape=shape
        )
    impls["one_row_fused_norm_res"] = lambda x, q, s, b: one_row.qmv_one_row(
        x, q, s, b, group_size=GS, bits=4, **_fused_extras(x, q)
    )
    ref = [impls["stock"](xs[k], q, s, b) for q, s, b, k in layers[0]]
    for name, impl in impls.items():
        try:
            err = 0.0
            if name != "read_only" and "fused" not in name:
                got = [impl(xs[k], q, s, b) for q, s, b, k in layers[0]]
                err = max(
                    (mx.abs(g.astype(mx.float32) - r.astype(mx.float32)).max() / mx.abs(r).max()).item()
                    for g, r in zip(got, ref, strict=True)
                )
            ms, enc = timed(lambda impl=impl: [impl(xs[k], q, s, b) for q, s, b, k in chain])
            row = dict(
                kind="qmv",
                impl=name,
                ms=round(ms, 2),
                encode_ms=round(enc, 2),
                gbs=round(nbytes / ms / 1e6, 1),
            )
            row["rel_err"] = round(err, 5)
        except Exception as e:  # a launch shape that fails must not hide the others
            row = dict(kind="qmv", impl=name, error=str(e)[:300])
        _emit(row)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["4b", "nemotron-30b-a3b"])
    ap.add_argument("--skip", nargs="*", default=[])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--engines", nargs="+", default=["kapitsa", "mlx-lm"])
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    if args.tiny:
        DTYPE["value"] = mx.float32
    print(f"mlx {mx.__version__} on {mx.default_device()}", flush=True)
    if "micro" not in args.skip:
        micro()
    if "qmv" not in args.skip and not args.tiny:
        qmv_sweep()
    for name in args.shapes:
        shape_costs(name, TINY if args.tiny else SHAPES, args.prompt, args.steps, args.engines)


if __name__ == "__main__":
    main()
