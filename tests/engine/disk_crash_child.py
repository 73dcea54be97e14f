"""The process that test_prefix_disk's kill loop kills: it answers a probe conversation from whatever
the disk tier holds, reports it as one JSON line, then extends the conversation turn after turn (each
turn a new checkpoint for the background writer) until it is killed.

Run as `python disk_crash_child.py FOLDER RUN KIND`. Each fsync sleeps first, so a kill often lands
between a checkpoint's temporary file and its rename.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

from engine_standins import EOS, ByteTokenizer, tiny_model

from kapitsa.engine.cache import file as prefix_file
from kapitsa.engine.inprocess import InProcessEngine
from kapitsa.engine.options import EngineConfig
from kapitsa.engine.types import FinishEvent, GenerationRequest, ModelInfo, SamplingParams, TokenEvent

PROBE = (
    {"role": "system", "content": "You are a terse agent. " * 8},
    {"role": "user", "content": "List the files."},
)
PROBE_TOKENS = 64


async def _chat(client: InProcessEngine, messages, max_tokens: int) -> tuple[list[int], int]:
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    request = GenerationRequest(messages=tuple(messages), sampling=sampling)
    ids, cached = [], 0
    async for event in client.generate(request):
        if isinstance(event, TokenEvent):
            ids += event.token_ids
        elif isinstance(event, FinishEvent):
            cached = event.usage.cached_tokens
    return ids, cached


def _slow_fsync(real):
    def sync(fd: int) -> None:
        time.sleep(0.02)
        real(fd)

    return sync


async def main(folder: Path, run: int, kind: str) -> None:
    prefix_file.sync_file = _slow_fsync(prefix_file.sync_file)
    info = ModelInfo(id="tiny", family="test", context_length=4096, max_output_tokens=256)
    config = EngineConfig(prefill_chunk=64, disk_cache_dir=folder, model_key="crash", disk_write_delay_s=0.0)
    client = InProcessEngine(tiny_model(kind), ByteTokenizer(), info, eos_token_ids={EOS}, config=config)
    ids, cached = await _chat(client, PROBE, PROBE_TOKENS)
    corrupt = client.stats().corrupt_checkpoints_deleted
    print(json.dumps({"probe": ids, "cached": cached, "corrupt": corrupt}), flush=True)
    messages = list(PROBE)
    for turn in range(10_000):
        messages += [
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": f"run {run} turn {turn}"},
        ]
        await _chat(client, messages, 2)


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]))
