"""Engine benchmark for issue 4's "Done when":

1. time to first token of turn N+1 of a ~4k-token agent conversation, with the prefix cache warm
   (turn N just ran on the same engine) vs cold (a fresh engine without a prefix cache);
2. wall time of 4 concurrent streams vs the same 4 requests one after another.

Usage:
    python lab/engine_bench.py                       # tiny random checkpoints of both families
    python lab/engine_bench.py --model PATH_OR_ID    # a real model (folder, .gguf, cached repo id)
    python lab/engine_bench.py --kind nemotron_h --context 4096 --streams 4 --max-tokens 64 --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

from kapitsa.engine.inprocess import InProcessEngine
from kapitsa.engine.loading.loader import load_model
from kapitsa.engine.options import EngineConfig
from kapitsa.engine.types import ErrorEvent, FinishEvent, GenerationRequest, SamplingParams, TokenEvent
from lab.engine_timing import DEFAULTS  # the KAPITSA_* kernel options of this process

FILLER = "Rule {i}: read the file before editing it, keep changes minimal, and run the tests afterwards."


async def timed(client: InProcessEngine, request: GenerationRequest) -> dict:
    """Stream one request; return its text, time to first token and total time."""
    start = time.perf_counter()
    first = None
    text = ""
    async for event in client.generate(request):
        if isinstance(event, TokenEvent):
            first = first or time.perf_counter()
            text += event.text
        elif isinstance(event, ErrorEvent):
            raise event.error
        elif isinstance(event, FinishEvent):
            end = time.perf_counter()
            return {
                "text": text,
                "ttft_s": (first or end) - start,
                "total_s": end - start,
                "usage": event.usage,
            }
    raise RuntimeError("stream ended without a finish event")


def conversation(tokenizer, target_tokens: int, turns: int) -> list[dict]:  # noqa: ANN001
    """A system prompt padded so that system + `turns` short exchanges render to ~target_tokens."""
    lines, messages = [], []
    while True:
        lines.append(FILLER.format(i=len(lines)))
        messages = [{"role": "system", "content": "\n".join(lines)}]
        for t in range(turns):
            messages += [
                {"role": "user", "content": f"Step {t}: inspect module_{t}.py."},
                {"role": "assistant", "content": f"Module {t} looks fine."},
            ]
        if len(tokenizer.encode(tokenizer.apply_chat_template(messages))) >= target_tokens:
            return messages


def request(messages: list[dict], max_tokens: int) -> GenerationRequest:
    return GenerationRequest(
        messages=tuple(messages), sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    )


async def bench_ttft(loaded, args) -> dict:  # noqa: ANN001
    """Turn N+1's TTFT after turn N ran on the same engine, vs on a fresh engine with no prefix cache."""
    history = conversation(loaded.tokenizer, args.context, turns=4)
    turn_n = [*history, {"role": "user", "content": "Step 4: now fix the failing test."}]
    warm_engine = InProcessEngine.from_loaded(
        loaded, config=EngineConfig(prefill_chunk=args.prefill_chunk, kernels=DEFAULTS)
    )
    try:
        reply = await timed(warm_engine, request(turn_n, 16))
        next_turn = [
            *turn_n,
            {"role": "assistant", "content": reply["text"]},
            {"role": "user", "content": "Step 5: run the tests again."},
        ]
        warm = await timed(warm_engine, request(next_turn, 1))
    finally:
        warm_engine.close()
    cold_engine = InProcessEngine.from_loaded(
        loaded, config=EngineConfig(prefill_chunk=args.prefill_chunk, prefix_cache_bytes=0, kernels=DEFAULTS)
    )
    try:
        cold = await timed(cold_engine, request(next_turn, 1))
    finally:
        cold_engine.close()
    return {
        "prompt_tokens": warm["usage"].prompt_tokens,
        "cached_tokens": warm["usage"].cached_tokens,
        "ttft_warm_s": round(warm["ttft_s"], 4),
        "ttft_cold_s": round(cold["ttft_s"], 4),
        "warm_over_cold": round(warm["ttft_s"] / cold["ttft_s"], 4),
    }


async def bench_concurrency(loaded, args) -> dict:  # noqa: ANN001
    """N streams at once vs the same N one after another (no prefix cache, so neither side reuses)."""
    prompts = [
        [{"role": "user", "content": f"Request {i}: summarise module_{i}.py in detail. " * 4}]
        for i in range(args.streams)
    ]
    engine = InProcessEngine.from_loaded(
        loaded, config=EngineConfig(prefill_chunk=args.prefill_chunk, prefix_cache_bytes=0, kernels=DEFAULTS)
    )
    try:
        await timed(
            engine, request(prompts[0], 4)
        )  # warm-up: first-call compilation is not the engine's cost
        start = time.perf_counter()
        sequential = [await timed(engine, request(p, args.max_tokens)) for p in prompts]
        sequential_s = time.perf_counter() - start
        start = time.perf_counter()
        concurrent = await asyncio.gather(*(timed(engine, request(p, args.max_tokens)) for p in prompts))
        concurrent_s = time.perf_counter() - start
    finally:
        engine.close()
    same = [r["text"] for r in sequential] == [r["text"] for r in concurrent]
    return {
        "streams": args.streams,
        "max_tokens": args.max_tokens,
        "sequential_s": round(sequential_s, 3),
        "concurrent_s": round(concurrent_s, 3),
        "concurrent_over_sequential": round(concurrent_s / sequential_s, 4),
        "same_outputs": same,
    }


async def bench_model(spec: str, args) -> dict:  # noqa: ANN001
    loaded = load_model(spec)
    return {
        "model": loaded.info.id,
        "ttft": await bench_ttft(loaded, args),
        "concurrency": await bench_concurrency(loaded, args),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", help="a model folder, .gguf or cached repo id (default: tiny random checkpoints)"
    )
    parser.add_argument(
        "--kind", action="append", help="tiny checkpoint kind(s) (default: qwen3_5 and nemotron_h)"
    )
    parser.add_argument(
        "--context", type=int, default=4096, help="tokens in the conversation before turn N+1"
    )
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = []
    if args.model:
        results.append(asyncio.run(bench_model(args.model, args)))
    else:
        from kapitsa.testing.tiny import write_tiny_checkpoint

        with tempfile.TemporaryDirectory() as tmp:
            for kind in args.kind or ["qwen3_5", "nemotron_h"]:
                path = write_tiny_checkpoint(Path(tmp) / kind, kind)
                results.append({"kind": kind, **asyncio.run(bench_model(str(path), args))})
    if args.json:
        print(json.dumps(results, indent=2))
        return
    for r in results:
        t, c = r["ttft"], r["concurrency"]
        print(
            f"{r.get('kind', r['model'])}: turn N+1 TTFT warm {t['ttft_warm_s']:.3f}s vs cold {t['ttft_cold_s']:.3f}s "
            f"= {100 * t['warm_over_cold']:.1f}% ({t['cached_tokens']}/{t['prompt_tokens']} prompt tokens cached); "
            f"{c['streams']} streams concurrent {c['concurrent_s']:.2f}s vs sequential {c['sequential_s']:.2f}s "
            f"= {100 * c['concurrent_over_sequential']:.0f}% (same outputs: {c['same_outputs']})"
        )


if __name__ == "__main__":
    main()
