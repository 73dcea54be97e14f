"""One launched rank of test_group_prefix.py: for each `parallel=folder` argument, load that shard
and (rank 0) run a prompt, then its extension (prompt + answer + new tokens), then an unrelated
prompt that evicts the first two's states, then the extension again. Every rank prints one JSON
line per model: rank 0 what it got, each rank the ids of the states it holds at the end."""

from __future__ import annotations

import asyncio
import json
import sys
import time

from kapitsa.commands.run import generate
from kapitsa.engine.distributed.engine import GroupEngine
from kapitsa.engine.distributed.follower import follow
from kapitsa.engine.distributed.group import barrier, init_group
from kapitsa.engine.distributed.loading import load_shard
from kapitsa.engine.distributed.speculation import GroupSpeculation
from kapitsa.engine.distributed.start import make_shard
from kapitsa.engine.options import KernelOptions
from kapitsa.engine.types import GenerationRequest, SamplingParams

FIRST = (11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22)
NEW = (40, 41, 42, 43, 44)
OTHER = (90, 91, 92, 93, 94, 95, 96, 97, 98, 99, 100, 101, 102, 103, 104, 105, 106, 107, 108, 109)
MAX_TOKENS = 10


def request(ids: tuple[int, ...]) -> GenerationRequest:
    return GenerationRequest(prompt_token_ids=ids, sampling=SamplingParams(max_tokens=MAX_TOKENS))


def ask(engine: GroupEngine, ids: tuple[int, ...]) -> dict:
    before = engine.stats().prompt_tokens_computed
    out = asyncio.run(generate(engine, request(ids), None))
    settle(engine)
    stats = engine.stats()
    return {"tokens": out.token_ids, "cached": out.cached_tokens, "bytes": stats.checkpoint_bytes_in_memory,
            "computed": stats.prompt_tokens_computed - before}  # fmt: skip


def settle(engine: GroupEngine) -> None:
    """Wait until every rank has applied rank 0's saves and evictions."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (
        engine.shard.saved.ids() != engine.prefix.ids()
        or engine.stats().checkpoint_bytes_in_memory != engine.shard.saved.nbytes()
    ):
        time.sleep(0.05)


def serve(engine: GroupEngine) -> dict:
    first = ask(engine, FIRST)
    extended = FIRST + tuple(first["tokens"]) + NEW
    second = ask(engine, extended)
    engine.prefix.budget_bytes = second["bytes"] - 1  # the next request's state evicts these
    other = ask(engine, OTHER)
    again = ask(engine, extended)
    return {"first": first, "second": second, "other": other, "again": again, "extended": extended,
            "budget": engine.prefix.budget_bytes, "index": engine.prefix.ids(), "ids": engine.shard.saved.ids()}  # fmt: skip


def main() -> None:
    group = init_group()
    for argument in sys.argv[1:]:
        parallel, folder = argument.split("=", 1)
        loaded = load_shard(folder, group=group, parallel=parallel)
        shard = make_shard(loaded, group, parallel, KernelOptions())
        barrier(group, what="startup")
        line: dict = {"rank": group.rank, "case": argument}
        if group.is_driver:
            engine = GroupEngine(shard, loaded, speculation=GroupSpeculation(), prefix_cache_bytes=1 << 30)
            line |= serve(engine)
            engine.close()
        else:
            follow(shard, group)
            line["ids"] = shard.saved.ids()
        sys.stdout.write(json.dumps(line) + "\n")  # one write: ranks share the launcher's stdout
        sys.stdout.flush()


if __name__ == "__main__":
    main()
