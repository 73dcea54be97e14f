"""What a reasoning budget costs while it is not reached: greedy decode tok/s of one engine with no
budget and with one far past the answer (the row leaves the shared-argmax path for the sampler's own),
rounds alternating, medians.

    python lab/reasoning_budget_cost.py [--model demo] [--tokens 256] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import time

from kapitsa.engine.types import FinishEvent, GenerationRequest, SamplingParams, TokenEvent
from kapitsa.opener import open_engine


async def _decode_tok_s(client, tokens: int, budget: tuple[int, int] | None) -> float:
    ids = tuple((i * 31) % 8000 + 10 for i in range(64))
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, reasoning_budget=budget)
    first = end = None
    produced = 0
    async for event in client.generate(GenerationRequest(prompt_token_ids=ids, sampling=params)):
        if isinstance(event, TokenEvent) and first is None:
            first = time.perf_counter()
        elif isinstance(event, FinishEvent):
            end, produced = time.perf_counter(), event.usage.completion_tokens
    return (produced - 1) / max(end - first, 1e-9)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="demo")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    with contextlib.closing(open_engine(args.model, speculative="none")) as client:
        close = client.models()[0].thinking_prompt.close_token
        if close is None:
            raise SystemExit("this model's </think> is not one token: it takes no budget")
        variants = {"none": None, "budget": (10 * args.tokens, close)}
        asyncio.run(_decode_tok_s(client, args.tokens, None))  # first-use compiles
        runs: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, budget in variants.items():
                runs[name].append(asyncio.run(_decode_tok_s(client, args.tokens, budget)))
    summary = {name: round(statistics.median(v), 1) for name, v in runs.items()}
    print(
        json.dumps({"runs": {k: [round(x, 1) for x in v] for k, v in runs.items()}, "median_tok_s": summary})
    )


if __name__ == "__main__":
    main()
