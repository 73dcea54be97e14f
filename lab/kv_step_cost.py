"""One attention layer's decode-step pieces after a short and a long context, each timed alone on
the device: the KV cache write (`KVCache.update`, whose `slice_update` is in place only when MLX can
donate the buffer; otherwise it copies the whole cache; the same with a static position; and
`KVCache.append_row`, the decode kernel's write into the cache's tail), kapitsa's decode attention
kernel, and MLX's attention over the same keys. Each call evaluated on its own, as a decode step
evaluates.

    python lab/kv_step_cost.py [--lengths 512 8192] [--steps 32]     # Qwen3.5-4B's attention shape
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx

from kapitsa.engine.cache.layers import KVCache, StepInfo
from kapitsa.engine.kernels import attention, backend
from lab.kernels_attn import per_call_us

B, HQ, HKV, D = 1, 16, 4, 256  # the 4B's attention layer


def _us(fn, steps: int) -> float:
    return round(per_call_us(fn, steps), 1)


def bench(length: int, steps: int) -> dict:
    cache = KVCache(HKV, D)
    keys = mx.random.normal((B, HKV, length, D)).astype(mx.bfloat16)
    cache.update(keys, keys, StepInfo(length, [length], [0]))
    mx.eval(cache.keys, cache.values)
    row = mx.random.normal((B, HKV, 1, D)).astype(mx.bfloat16)
    q = mx.random.normal((B, HQ, 1, D)).astype(mx.bfloat16)
    mx.eval(row, q)

    def write(i):
        cache.update(row, row, StepInfo(1, [1], [length + i]))
        return cache.keys, cache.values

    def write_static(i):  # the same write with the position as a Python int (MLX's static SliceUpdate)
        at = length + steps + 1 + i
        cache.keys[:, :, at : at + 1] = row
        cache.values[:, :, at : at + 1] = row
        return cache.keys, cache.values

    def write_tail(i):  # the decode kernel's write: a row into the tail, the cache untouched
        at = length + 2 * steps + 2 + i
        return cache.append_row(row, row, StepInfo(1, [1], [at]))[3:]

    out = dict(length=length, write_us=_us(write, steps))
    out["write_static_us"] = _us(write_static, steps)
    out["write_tail_us"] = _us(write_tail, steps)
    held = length + 3 * steps + 3  # every key written above (reading `keys` folds the tail)
    if attention.supports(q, cache.keys, cache.values) and attention.probe():
        for splits in (None, 64, 128):  # `splits_for`'s count, then more blocks for one call alone
            out[f"kernel_{splits or 'default'}_us"] = _us(
                lambda i, s=splits: attention.decode_attention(
                    q, cache.keys, cache.values, held, scale=D**-0.5, splits=s
                ),
                steps,
            )
    out["mlx_us"] = _us(
        lambda i: attention.decode_attention_reference(q, cache.keys, cache.values, held, scale=D**-0.5),
        steps,
    )
    out["empty_eval_us"] = _us(lambda i: q + i, steps)  # what one evaluation costs alone
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 8192])
    ap.add_argument("--steps", type=int, default=32)
    args = ap.parse_args()
    print(f"mlx {mx.__version__} on {mx.default_device()} ({backend()})", flush=True)
    for _ in range(2):
        for length in args.lengths:
            print(json.dumps(bench(length, args.steps)), flush=True)


if __name__ == "__main__":
    main()
