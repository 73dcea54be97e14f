"""GPU time of a decode step by kernel, for Nsight Systems: kapitsa's model of a real shape (fused and
routed as the engine runs it) prefills a prompt, warms up, then decodes `--steps` tokens inside a
cudaProfilerStart/Stop range, so `nsys profile --capture-range=cudaProfilerApi` records only them.

    nsys profile -t cuda --cuda-graph-trace=node --capture-range=cudaProfilerApi -o /tmp/steps \
        python lab/decode_kernels.py --shape 27b
    python lab/decode_kernels.py --summarize /tmp/steps.sqlite --steps 16   # kernel table per step

`--summarize` reads the report's CUPTI_ACTIVITY_KIND_KERNEL table (nsys's SQLite export) and prints
JSON lines: per kernel family (the name up to its template arguments), milliseconds per step and
share of the step's GPU time, largest first, then the step's total GPU time and kernel count.
CPU smoke run: python lab/decode_kernels.py --tiny --shape 4b --steps 2
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import json
import re
import sqlite3

import mlx.core as mx

from kapitsa.engine.runner.model_runner import ModelRunner
from kapitsa.testing.tiny import tiny_config
from lab.decode_profile import _kapitsa_step
from lab.engine_timing import DEFAULTS
from lab.models_under_test import DTYPE, SHAPES, TINY, kapitsa_model


def _cudart():
    for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def decode(shape: str, steps: int, prompt_len: int, tiny: bool) -> None:
    kind, dims = (TINY if tiny else SHAPES)[shape]
    model = kapitsa_model(tiny_config(kind, **dims))
    # fuses projections and routes quantized linears, as the engine does, under the KAPITSA_*
    # kernel options of this process's environment (engine_timing.DEFAULTS)
    ModelRunner(model, kernels=DEFAULTS)
    prefill, step = _kapitsa_step(model)
    vocab = dims.get("vocab_size", 512)
    tok = mx.argmax(prefill([(i * 7919) % (vocab - 10) + 5 for i in range(prompt_len)]), axis=-1)
    tok = tok[:, None].astype(mx.int32)
    for _ in range(8):  # warm-up: compiles, allocations
        tok = mx.argmax(step(tok), axis=-1)[:, None].astype(mx.int32)
        mx.eval(tok)
    cudart = None if tiny else _cudart()
    if cudart is not None:
        mx.synchronize()
        cudart.cudaProfilerStart()
    for _ in range(steps):  # pipelined, as the engine decodes
        tok = mx.argmax(step(tok), axis=-1)[:, None].astype(mx.int32)
        mx.async_eval(tok)
    mx.eval(tok)
    mx.synchronize()
    if cudart is not None:
        cudart.cudaProfilerStop()
    print(json.dumps(dict(shape=shape, steps=steps, profiler_range=cudart is not None)), flush=True)


def family(name: str) -> str:
    """A kernel's family: its name without template arguments and custom-kernel instance suffixes."""
    name = name.split("<", 1)[0].split("(", 1)[0].strip()
    name = re.sub(r"^void ", "", name)
    return re.sub(r"_(bfloat16_t|float16_t|float32_t|\d+|[ft])(_.*)?$", "", name)


def summarize(path: str, steps: int) -> None:
    con = sqlite3.connect(path)
    rows = con.execute(
        "SELECT s.value, k.end - k.start FROM CUPTI_ACTIVITY_KIND_KERNEL k JOIN StringIds s ON k.demangledName = s.id"
    ).fetchall()
    total = collections.Counter()
    count = collections.Counter()
    for name, ns in rows:
        total[family(name)] += ns
        count[family(name)] += 1
    step_ns = sum(total.values())
    for name, ns in total.most_common(30):
        print(json.dumps(dict(
            kernel=name,
            ms_per_step=round(ns / steps / 1e6, 3),
            share=round(ns / step_ns, 3),
            launches_per_step=round(count[name] / steps, 1),
        )), flush=True)  # fmt: skip
    print(json.dumps(dict(
        kind="step_total", gpu_ms_per_step=round(step_ns / steps / 1e6, 3),
        launches_per_step=round(sum(count.values()) / steps, 1),
    )), flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="27b")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--summarize", metavar="SQLITE", default=None)
    args = ap.parse_args()
    if args.summarize:
        summarize(args.summarize, args.steps)
        return
    if args.tiny:
        DTYPE["value"] = mx.float32
    decode(args.shape, args.steps, args.prompt, args.tiny)


if __name__ == "__main__":
    main()
