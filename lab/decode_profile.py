"""Where a decode step's time goes, kapitsa vs mlx-lm, on random-weight 4-bit models of real shapes.

Per step, split into: building the graph in Python (`build`), `mx.async_eval` returning (the
backend encoding and launching the step's kernels: `encode`), and waiting for the token
(`wait`: device time not hidden behind the host work). Also the pipelined tok/s (next step queued
before reading the previous token, as both engines decode) and kapitsa's engine tok/s.

    python lab/decode_profile.py --shapes 27b --steps 32 --json profile.json
    python lab/decode_profile.py --tiny          # CPU smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import time

import mlx.core as mx

from kapitsa.engine.loading.fuse import fuse_model
from kapitsa.engine.models.base import use_kernel_options
from kapitsa.engine.ops.linear import route_quantized_linears
from kapitsa.testing.tiny import tiny_config
from lab.engine_timing import DEFAULTS, rounded, time_kapitsa
from lab.models_under_test import DTYPE, SHAPES, TINY, kapitsa_model, mlxlm_model

OP_BY_OP = dataclasses.replace(DEFAULTS, compile_decode=False)


def _kapitsa_step(model):
    cache = {}

    def prefill(prompt):
        cache["c"] = model.make_cache(1)
        return model(mx.array([prompt]), cache["c"])[:, -1]

    return prefill, lambda tok: model(tok, cache["c"])[:, -1]


def _mlxlm_step(model):
    cache = {}

    def prefill(prompt):
        cache["c"] = model.make_cache()
        return model(mx.array([prompt]), cache=cache["c"])[:, -1]

    return prefill, lambda tok: model(tok, cache=cache["c"])[:, -1]


def _profile(prefill, step, prompt: list[int], steps: int) -> dict:
    logits = prefill(prompt)
    tok = mx.argmax(logits, axis=-1)[:, None].astype(mx.int32)
    mx.eval(tok)
    build, encode, wait = [], [], []
    for _ in range(steps):  # synchronous steps, each split in three
        t0 = time.perf_counter()
        nxt = mx.argmax(step(tok), axis=-1)[:, None].astype(mx.int32)
        t1 = time.perf_counter()
        mx.async_eval(nxt)
        t2 = time.perf_counter()
        nxt.item()
        t3 = time.perf_counter()
        build.append(t1 - t0)
        encode.append(t2 - t1)
        wait.append(t3 - t2)
        tok = nxt
    # pipelined: queue step n+1 before reading step n's token
    t0 = time.perf_counter()
    nxt = mx.argmax(step(tok), axis=-1)[:, None].astype(mx.int32)
    mx.async_eval(nxt)
    for _ in range(steps):
        cur = nxt
        nxt = mx.argmax(step(cur), axis=-1)[:, None].astype(mx.int32)
        mx.async_eval(nxt)
        cur.item()
    nxt.item()
    pipelined = (time.perf_counter() - t0) / (steps + 1)

    def ms(xs):
        return round(1000 * statistics.median(xs), 3)

    return dict(
        build_ms=ms(build),
        encode_ms=ms(encode),
        wait_ms=ms(wait),
        sync_step_ms=ms([a + b + c for a, b, c in zip(build, encode, wait, strict=True)]),
        pipelined_step_ms=round(1000 * pipelined, 3),
        pipelined_tok_s=round(1 / pipelined, 1),
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["27b"])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--engine", action="store_true", help="also time kapitsa's engine (fused)")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    table = TINY if args.tiny else SHAPES
    if args.tiny:
        DTYPE["value"] = mx.float32
    print(f"mlx {mx.__version__} on {mx.default_device()}", flush=True)
    rows = []

    def record(shape, variant, result):
        row = dict(shape=shape, variant=variant, **result)
        rows.append(row)
        print(json.dumps(row), flush=True)

    for name in args.shapes:
        kind, dims = table[name]
        config = tiny_config(kind, **dims)
        vocab = dims.get("vocab_size", 512)
        prompt = [(i * 7919) % (vocab - 10) + 5 for i in range(args.prompt)]
        model = mlxlm_model(config)
        for _ in range(2):  # the first pass includes kernel JIT
            record(name, "mlx-lm", _profile(*_mlxlm_step(model), prompt, args.steps))
        del model
        gc.collect()
        mx.clear_cache()
        model = kapitsa_model(config)
        use_kernel_options(model, OP_BY_OP)
        record(name, "kapitsa op-by-op", _profile(*_kapitsa_step(model), prompt, args.steps))
        fuse_model(model)
        record(name, "kapitsa fused op-by-op", _profile(*_kapitsa_step(model), prompt, args.steps))
        use_kernel_options(model, DEFAULTS)
        for _ in range(2):
            record(name, "kapitsa fused+compiled", _profile(*_kapitsa_step(model), prompt, args.steps))
        route_quantized_linears(model, DEFAULTS)  # what the engine runs (kapitsa/engine/ops/linear.py)
        for _ in range(2):
            record(name, "kapitsa fused+compiled+routed", _profile(*_kapitsa_step(model), prompt, args.steps))
        if args.engine:
            out = time_kapitsa(model, prompt, args.steps * 2)
            record(name, "kapitsa engine", rounded(out, 3))
        del model
        gc.collect()
        mx.clear_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
