"""Where a many-row decode's device memory goes: kapitsa's engine (warmed as serve's) runs bursts of
N streams on a random-weight 4-bit model of a real shape while a thread samples, every few
milliseconds, what the device has in use in all (NVML), what MLX's arrays hold and cache, and what
CUDA's default memory pool and its graph-memory pool reserve (cudart, through ctypes). One JSON
line per burst with each figure's maximum and the samples around the device's highest use, so a
gap between MLX's count and the device's has a name.

    python lab/rows_memory.py --shape 27b --streams 8,16 --with-mlxlm --mlxlm-prefill 8192
    python lab/rows_memory.py --tiny --shape 27b --streams 2,4 --tokens 8 --prompt 32   # any machine

`--with-mlxlm` also holds mlx-lm's model of the shape (as the table's process does) and
`--mlxlm-prefill N` runs it over an N-token prompt first, as the table's batch-1 rounds do.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import mlx.core as mx

from lab.batch_sweep import engine, wait_warm
from lab.device_memory import DeviceProbe, Sampler
from lab.engine_timing import emit, stream
from lab.models_under_test import DTYPE, SHAPES, TINY, kapitsa_model, mlxlm_model, prompt_ids


def summary(samples: list[dict], start: float) -> dict:
    """Each figure's maximum, and the samples (rounded) around the device's highest use."""
    if not samples:
        return {"samples": 0}
    keys = [k for k in samples[0] if k != "t"]
    out = {f"max_{k}_gb": round(max(s[k] or 0.0 for s in samples), 2) for k in keys}
    focus = "device_used" if "device_used" in keys else "active"
    top = max(range(len(samples)), key=lambda i: samples[i][focus] or 0.0)
    near = samples[max(top - 3, 0) : top + 4]
    out["around_top"] = [
        {"t_s": round(s["t"] - start, 3), **{k: round(s[k] or 0.0, 2) for k in keys}} for s in near
    ]
    out["samples"] = len(samples)
    return out


def burst(client, prompts: list[list[int]], tokens: int) -> dict:
    """N streams at once; the engine's counters where it has them (an older tree, through
    PYTHONPATH, for an A/B of the same burst, lacks the send-back ones)."""

    async def run():
        return await asyncio.gather(*(stream(client, p, tokens) for p in prompts))

    sent_back = getattr(client.stats(), "requests_sent_back", None)
    start = time.perf_counter()
    results = asyncio.run(run())
    wall = time.perf_counter() - start
    span = max(r[2] for r in results) - max(r[1] for r in results)
    out = dict(
        wall_s=round(wall, 3), aggregate_tok_s=round(sum(len(r[3]) - 1 for r in results) / max(span, 1e-9), 2)
    )
    if sent_back is not None:
        out["sent_back"] = client.stats().requests_sent_back - sent_back
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="27b")
    parser.add_argument("--streams", default="8,16")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--with-mlxlm", action="store_true")
    parser.add_argument("--mlxlm-prefill", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="small widths, float32 (any machine)")
    args = parser.parse_args()
    if args.tiny:
        DTYPE["value"] = mx.float32
    from kapitsa.testing.tiny import tiny_config

    kind, dims = (TINY if args.tiny else SHAPES)[args.shape]
    config = tiny_config(kind, **dims)
    vocab = (config.get("text_config") or config)["vocab_size"]
    probe = DeviceProbe()
    model = kapitsa_model(config)
    emit(dict(shape=args.shape, stage="built", **_rounded(probe.sample())))
    if args.with_mlxlm:
        reference = mlxlm_model(config)
        if args.mlxlm_prefill:
            reference(mx.array([prompt_ids(args.mlxlm_prefill, vocab)]))
            mx.eval(reference.parameters())
            mx.synchronize()
        emit(dict(shape=args.shape, stage="mlx-lm built", **_rounded(probe.sample())))
    streams = [int(n) for n in args.streams.split(",")]
    prompts = [prompt_ids(args.prompt, vocab, stride=7919 + 2 * i) for i in range(max(streams))]
    client = engine(model, args.prompt, args.tokens, max(streams), warm=True)
    try:
        warm_s = wait_warm(client)
        emit(dict(shape=args.shape, stage="warm", warmup_s=round(warm_s, 2), **_rounded(probe.sample())))
        burst(client, prompts[:1], 8)
        for n in streams:
            for attempt in ("first", "second"):
                sampler = Sampler(probe)
                start = time.perf_counter()
                sampler.start()
                timed = burst(client, prompts[:n], args.tokens)
                emit(
                    dict(
                        shape=args.shape, streams=n, burst=attempt, **timed, **summary(sampler.stop(), start)
                    )
                )
    finally:
        client.close()


def _rounded(sample: dict) -> dict:
    return {f"{k}_gb": round(v, 2) for k, v in sample.items() if k != "t" and v is not None}


if __name__ == "__main__":
    main()
