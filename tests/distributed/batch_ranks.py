"""Concurrent requests on a group (test_group_batch.py), in this process or on launched ranks.

`serve` sends three requests at once (a 600-token prompt among them, prefilled in two chunks
between decode steps), a fourth once the first has streamed 3 tokens, each with its own
max_tokens, so rows join and leave the batch at different steps; then the first one's extension,
which resumes from the state its batch row saved at its end. Run as a script, every rank loads
each `parallel=folder` argument's shard; rank 0 prints one JSON line per case with what `serve`
returned, the other ranks follow.
"""

from __future__ import annotations

import asyncio
import json
import sys

from kapitsa.engine.types import ErrorEvent, FinishEvent, GenerationRequest, SamplingParams, TokenEvent

LONG = tuple(11 + (7 * i) % 280 for i in range(600))
REQUESTS = {  # name: (prompt ids, max_tokens)
    "first": ((11, 12, 13, 14, 15), 12),
    "long": (LONG, 6),
    "mid": ((30, 31, 32, 33, 34, 35, 36, 37, 38), 16),
    "late": ((50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62), 8),
}
NEW = (40, 41, 42)
AGAIN_TOKENS = 6


def request(ids: tuple[int, ...], max_tokens: int) -> GenerationRequest:
    return GenerationRequest(prompt_token_ids=ids, sampling=SamplingParams(max_tokens=max_tokens))


async def _ask(engine, ids: tuple[int, ...], max_tokens: int, streamed: asyncio.Event | None = None) -> dict:  # noqa: ANN001
    """The tokens and cached count of one request; `streamed` is set once it has 3 tokens."""
    tokens: list[int] = []
    async for event in engine.generate(request(ids, max_tokens)):
        if isinstance(event, TokenEvent):
            tokens += event.token_ids
            if streamed is not None and len(tokens) >= 3:
                streamed.set()
        elif isinstance(event, ErrorEvent):
            raise event.error
        elif isinstance(event, FinishEvent):
            return {"tokens": tokens, "cached": event.usage.cached_tokens}
    raise AssertionError("the stream ended unfinished")


async def _concurrently(engine) -> tuple[dict, int]:  # noqa: ANN001
    """Every request's answer, and the largest batch the engine's stats showed meanwhile."""
    streamed = asyncio.Event()

    async def late() -> dict:
        await streamed.wait()
        return await _ask(engine, *REQUESTS["late"])

    first = _ask(engine, *REQUESTS["first"], streamed=streamed)
    others = [_ask(engine, *REQUESTS[name]) for name in ("long", "mid")]
    answers, peak = await _with_peak(engine, asyncio.gather(first, *others, late()))
    return dict(zip(("first", "long", "mid", "late"), answers, strict=True)), peak


async def ask_all(engine, prompts: list[tuple[tuple[int, ...], int]]) -> tuple[list[list[int]], int]:  # noqa: ANN001
    """Every prompt's tokens, all sent at once, and the largest batch the stats showed meanwhile."""
    answers, peak = await _with_peak(engine, asyncio.gather(*(_ask(engine, ids, n) for ids, n in prompts)))
    return [answer["tokens"] for answer in answers], peak


async def _with_peak(engine, requests):  # noqa: ANN001, ANN202
    """`requests`' result, and the largest batch the engine's stats showed while they ran."""
    peak, done = 0, False

    async def poll() -> None:
        nonlocal peak
        while not done:
            peak = max(peak, engine.stats().batch_size)
            await asyncio.sleep(0.001)

    poller = asyncio.create_task(poll())
    try:
        result = await requests
    finally:
        done = True
        await poller
    return result, peak


def serve(engine) -> dict:  # noqa: ANN001
    answers, peak = asyncio.run(_concurrently(engine))
    extended = REQUESTS["first"][0] + tuple(answers["first"]["tokens"]) + NEW
    again = asyncio.run(_ask(engine, extended, AGAIN_TOKENS))
    return {"answers": answers, "peak": peak, "again": again, "extended": extended}


def main() -> None:
    from kapitsa.engine.distributed.engine import GroupEngine
    from kapitsa.engine.distributed.follower import follow
    from kapitsa.engine.distributed.group import barrier, init_group
    from kapitsa.engine.distributed.loading import load_shard
    from kapitsa.engine.distributed.speculation import GroupSpeculation
    from kapitsa.engine.distributed.start import make_shard
    from kapitsa.engine.options import KernelOptions

    group = init_group()
    for argument in sys.argv[1:]:
        parallel, folder = argument.split("=", 1)
        loaded = load_shard(folder, group=group, parallel=parallel)
        shard = make_shard(loaded, group, parallel, KernelOptions())
        barrier(group, what="startup")
        if not group.is_driver:
            follow(shard, group)
            continue
        engine = GroupEngine(shard, loaded, speculation=GroupSpeculation(), prefix_cache_bytes=1 << 30)
        line = {"case": argument, **serve(engine)}
        engine.close()
        sys.stdout.write(json.dumps(line) + "\n")  # one write: ranks share the launcher's stdout
        sys.stdout.flush()


if __name__ == "__main__":
    main()
