"""Decode speed with picks queued lazily (pipelined decoding) against taken synchronously, for
sampling that once forced synchronous steps, alternating rounds in one process:
  decay     the checkpoint's own defaults (the demo's generation_config.json has
            `exponential_decay_length_penalty`, which every request without `ignore_eos` gets)
  presence  `presence_penalty` 1.5 (Qwen's advice for its models), output counts on the device

    python lab/pipelined_sampling.py [--model demo] [--sampling decay|presence] [--rounds 6]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from kapitsa.engine.runner.sampler import SequenceSampler
from kapitsa.engine.types import GenerationRequest, SamplingParams, TokenEvent
from kapitsa.opener import open_engine

MESSAGES = (
    {"role": "user", "content": "Write a long Python module with many small functions and docstrings."},
)


SAMPLING = {"decay": {}, "presence": {"presence_penalty": 1.5, "ignore_eos": True}}


async def _decode_tok_s(engine, extra: dict) -> float:  # noqa: ANN001 - an EngineClient
    sampling = SamplingParams(temperature=0, max_tokens=128, **extra)
    count, first = 0, None
    async for event in engine.generate(GenerationRequest(messages=MESSAGES, sampling=sampling)):
        if isinstance(event, TokenEvent) and event.token_ids:
            count += len(event.token_ids)
            first = first or time.perf_counter()
    return (count - 1) / (time.perf_counter() - first)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="demo")
    parser.add_argument("--sampling", choices=sorted(SAMPLING), default="decay")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    lazy = SequenceSampler.is_stateless
    settings = {
        "synchronous": property(
            lambda self: lazy.fget(self) and self._eos_ids is None and not self._penalties.active
        ),
        "pipelined": lazy,
    }
    engine = open_engine(args.model, speculative="none")
    extra = SAMPLING[args.sampling]
    asyncio.run(_decode_tok_s(engine, extra))  # one-time costs outside the timing
    rates: dict[str, list[float]] = {name: [] for name in settings}
    for _ in range(args.rounds):
        for name, stateless in settings.items():
            SequenceSampler.is_stateless = stateless
            rates[name].append(round(asyncio.run(_decode_tok_s(engine, extra)), 1))
    SequenceSampler.is_stateless = lazy
    engine.close()
    print(json.dumps({name: {"tok_s": r, "median": statistics.median(r)} for name, r in rates.items()}))


if __name__ == "__main__":
    main()
