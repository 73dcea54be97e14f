"""Time kapitsa's decode attention kernel (kernels/attention.py) on Qwen3.5's attention shapes at
growing context lengths: the split count `splits_for` picks against another one (`--splits`),
and MLX's own attention over the same keys (the path without the kernel).

    python lab/kernels_attn.py [--lengths 512 2048 8192 32768] [--batch 1 8] [--calls 24]

One JSON line per (shape, batch, length): microseconds per layer call of each over `--calls`
calls after a warm-up, and the largest difference from the reference. Each call is evaluated
alone, as a decode step's attention calls run one after another (each layer waits for the one
before): calls queued together are independent and the GPU overlaps them, which hides how long
one call takes. The time includes one evaluation's fixed cost (lab/kv_step_cost.py's
`empty_eval_us`, ~25 us on an H100). The calls take turns over BUFFERS caches of their own, as a
step's layers read theirs: one cache read again and again would sit in L2 (50 MB on an H100) at
short contexts. Needs CUDA (the kernel's only backend).
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx

from kapitsa.engine.kernels import attention, backend

SHAPES = {  # query heads, kv heads, head size of the attention layers
    "qwen3.5-4b": (16, 4, 256),
    "qwen3.5-27b": (24, 4, 256),
    "qwen3.5-35b-a3b": (16, 2, 256),
}


BUFFERS = 8  # distinct caches the timed calls cycle through: 8 x 33.5 MB at 8k keys on the 4B


def per_call_us(fn, calls: int) -> float:
    """`fn(i)` is call i's work, evaluated alone: call 0 warms up, calls 1..`calls` are timed."""
    mx.eval(fn(0))  # compiles, allocates
    mx.synchronize()
    start = time.perf_counter()
    for i in range(1, calls + 1):
        mx.eval(fn(i))
    mx.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def bench(name: str, B: int, length: int, calls: int, other: int) -> dict:
    hq, hkv, D = SHAPES[name]
    cap = length + 256
    keys = mx.random.split(mx.random.key(length), 4)
    q = mx.random.normal((B, hq, 1, D), key=keys[0]).astype(mx.bfloat16)
    k = mx.random.normal((B, hkv, cap, D), key=keys[1]).astype(mx.bfloat16)
    v = mx.random.normal((B, hkv, cap, D), key=keys[2]).astype(mx.bfloat16)
    gate = mx.random.normal((B, 1, hq * D), key=keys[3]).astype(mx.bfloat16)
    caches = [(k, v)] + [(k + n, v - n) for n in range(1, BUFFERS)]
    mx.eval(q, k, v, gate, caches)
    scale = D**-0.5
    ref = attention.decode_attention_reference(q, k, v, length, scale=scale, gate=gate).astype(mx.float32)
    chosen = attention.splits_for(length, hkv)
    row = dict(shape=name, batch=B, length=length, splits=chosen)
    for label, splits in (("kernel_us", None), (f"splits_{other}_us", other)):
        got = attention.decode_attention(q, k, v, length, scale=scale, gate=gate, splits=splits)
        row[label.replace("_us", "_max_diff")] = round(float(mx.abs(got.astype(mx.float32) - ref).max()), 5)
        row[label] = round(
            per_call_us(
                lambda i, s=splits: attention.decode_attention(
                    q, *caches[i % BUFFERS], length, scale=scale, gate=gate, splits=s
                ),
                calls,
            ),
            1,
        )
    row["mlx_us"] = round(
        per_call_us(
            lambda i: attention.decode_attention_reference(
                q, *caches[i % BUFFERS], length, scale=scale, gate=gate
            ),
            calls,
        ),
        1,
    )
    # the keys and values a call reads, over its time
    read = 2 * B * hkv * length * D * 2
    row["kernel_gb_s"] = round(read / row["kernel_us"] / 1e3, 1)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192, 32768])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--calls", type=int, default=24)
    ap.add_argument("--splits", type=int, default=16, help="the split count to compare with the default")
    args = ap.parse_args()
    if backend() != "cuda" or not attention.probe():
        raise SystemExit("needs CUDA and a working attention kernel")
    print(f"mlx {mx.__version__} on {mx.default_device()}", flush=True)
    for name in args.shapes:
        for B in args.batch:
            for length in args.lengths:
                print(json.dumps(bench(name, B, length, args.calls, args.splits)), flush=True)


if __name__ == "__main__":
    main()
