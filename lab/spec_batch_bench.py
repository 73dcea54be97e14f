"""Concurrent streams with and without speculation, on prompts an n-gram drafter drafts from.

Each stream's prompt is one token run repeated three times (rotated per stream), so n-gram lookup
proposes drafts wherever the output copies the prompt; some rows' drafts pay and others' do not.
Prints one JSON line per burst: aggregate tok/s (all streams' tokens over the burst's wall time)
and the verifies the speculating engine ran (its SpeculativeStats).

    .venv/bin/python lab/spec_batch_bench.py --model demo --streams 8 --modes none ngram
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import time

from kapitsa.engine.types import GenerationRequest, SamplingParams, TokenEvent
from kapitsa.opener import open_engine


def prompts(streams: int) -> list[tuple[int, ...]]:
    run = list(range(10, 200))
    return [tuple((run[i:] + run[:i]) * 3) for i in range(streams)]


async def _tokens(client, ids: tuple[int, ...], tokens: int) -> int:  # noqa: ANN001
    request = GenerationRequest(
        prompt_token_ids=ids, sampling=SamplingParams(max_tokens=tokens, ignore_eos=True)
    )
    return sum([len(e.token_ids) async for e in client.generate(request) if isinstance(e, TokenEvent)])


async def burst(client, streams: int, tokens: int) -> float:  # noqa: ANN001
    start = time.perf_counter()
    counts = await asyncio.gather(*(_tokens(client, ids, tokens) for ids in prompts(streams)))
    return sum(counts) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="demo")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=["none", "ngram"])
    args = parser.parse_args()
    for mode in args.modes:
        client = open_engine(args.model, speculative=mode)
        with contextlib.closing(client):
            asyncio.run(burst(client, args.streams, args.tokens))  # the first burst's traces
            rates = [
                round(asyncio.run(burst(client, args.streams, args.tokens)), 1) for _ in range(args.rounds)
            ]
            stats = getattr(client.engine.decode_strategy, "stats", None)
            verifies = dataclasses.asdict(stats) if stats is not None else None
            print(json.dumps(dict(mode=mode, streams=args.streams, aggregate_tok_s=rates, verifies=verifies)))


if __name__ == "__main__":
    main()
