"""Prefetch on the tiny engine: after memory pressure pushed an 8-turn agent conversation's checkpoints
to disk, an idle engine loads them back before the next turn arrives (prefetch on) or the lookup
reads the file then (off); a restarted engine reads the file ahead of the lookup, off its thread."""

from __future__ import annotations

import asyncio
import time

import mlx.core as mx
from engine_standins import OFFSET
from test_prefix_reuse import SYSTEM, chat

from kapitsa.engine.cache import disk as disk_module
from kapitsa.engine.types import FinishEvent, GenerationRequest, SamplingParams, TokenEvent, Usage

TURNS = 8
# Room next to the weights for a request reserving 4096 tokens (2.3 MB on the tiny model) and a
# little cache: its admission pushes the conversation's checkpoints to disk.
ROOM = int(2.6 * 2**20)
# One token, forced, that is also a stop string: the request ends at once.
SUB_AGENT = GenerationRequest(
    prompt="sub-agent", sampling=SamplingParams(logit_bias=((ord("x") + OFFSET, 100.0),), stop=("x",))
)


async def _first_token_s(client, messages) -> tuple[float, list[int], Usage]:
    """Time to first token, the generated ids and the usage of one chat request."""
    request = GenerationRequest(messages=tuple(messages), sampling=SamplingParams(max_tokens=8))
    t0, first, ids, usage = time.perf_counter(), 0.0, [], Usage()
    async for event in client.generate(request):
        if isinstance(event, TokenEvent):
            first = first or time.perf_counter() - t0
            ids += event.token_ids
        elif isinstance(event, FinishEvent):
            usage = event.usage
    return first, ids, usage


async def _turns_then_pressure(client) -> list[dict[str, str]]:
    """Seven turns, then a request whose admission spills the conversation; the eighth turn's messages."""
    messages = [{"role": "system", "content": SYSTEM}]
    for turn in range(TURNS - 1):
        messages.append({"role": "user", "content": f"Step {turn}: go on."})
        text, _, _ = await chat(client, messages)
        messages.append({"role": "assistant", "content": text})
    async for _ in client.generate(SUB_AGENT):
        pass
    messages.append({"role": "user", "content": f"Step {TURNS - 1}: go on."})
    return messages


async def _until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


def _pressed(make_client, model, tmp_path, **cfg):
    limit = mx.get_active_memory() + ROOM
    return make_client(
        model,
        disk_cache_dir=tmp_path,
        model_key="k",
        memory_limit_bytes=limit,
        prefix_cache_bytes=4 * 2**20,
        **cfg,
    )


async def test_idle_engine_preloads_the_spilled_conversation(qwen_model, make_client, tmp_path) -> None:
    client = _pressed(make_client, qwen_model, tmp_path)
    messages = await _turns_then_pressure(client)
    await _until(lambda: client.stats().checkpoints_preloaded >= 2)
    loaded = client.stats().checkpoints_loaded_from_disk
    assert client.stats().checkpoints_preloaded == loaded == 2  # the spilled head and anchor came back
    first_s, ids, usage = await _first_token_s(client, messages)
    assert client.stats().checkpoints_loaded_from_disk == loaded  # the lookup read no file: memory had it
    assert usage.cached_tokens >= 0.95 * usage.prompt_tokens
    cold_s, cold_ids, _ = await _first_token_s(make_client(qwen_model, prefix_cache_bytes=0), messages)
    assert ids == cold_ids
    # Only a loose bound: on a loaded 2-core machine one run may stall for seconds (lab/prefetch_ttft.py
    # measures the ratio, ~6-11% of cold, and the lookup's own time); the stats above already show
    # that memory served the prompt, so a fast absolute time passes too.
    assert first_s < 0.7 * cold_s or first_s < 0.5, (first_s, cold_s)


async def test_without_prefetch_the_lookup_reads_the_file(qwen_model, make_client, tmp_path) -> None:
    client = _pressed(make_client, qwen_model, tmp_path / "off", prefetch=False)
    messages = await _turns_then_pressure(client)
    await asyncio.sleep(0.1)  # idle time a preload would use
    stats = client.stats()
    assert stats.checkpoints_preloaded == 0 and stats.checkpoints_loaded_from_disk == 0
    _, _, usage = await _first_token_s(client, messages)
    stats = client.stats()
    assert stats.checkpoints_loaded_from_disk == 1 and stats.checkpoints_read_ahead == 0
    assert usage.cached_tokens >= 0.95 * usage.prompt_tokens


async def test_restarted_engine_reads_the_checkpoint_ahead_of_its_lookup(
    qwen_model, make_client, tmp_path, monkeypatch
) -> None:
    first = make_client(qwen_model, disk_cache_dir=tmp_path, model_key="k")
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
    text, _, _ = await chat(first, messages)
    first.close()  # flushes its checkpoints to disk
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "more"}]
    cold_ids = (await chat(make_client(qwen_model, prefix_cache_bytes=0), messages))[1]

    def no_read_on_the_engine_thread(path):
        raise AssertionError(f"the lookup read {path.name} itself")

    monkeypatch.setattr(disk_module, "read_prefix_file", no_read_on_the_engine_thread)
    restarted = make_client(qwen_model, disk_cache_dir=tmp_path, model_key="k")
    _, ids, finish = await chat(restarted, messages)
    assert ids == cold_ids and finish.usage.cached_tokens > len(SYSTEM)
    stats = restarted.stats()
    assert stats.checkpoints_read_ahead == 1 and stats.checkpoints_loaded_from_disk == 1
    assert stats.corrupt_checkpoints_deleted == 0
