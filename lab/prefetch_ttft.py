"""Time to first token of turn N+1 of a replayed agent conversation, against cold, with its state in
memory, and after memory pressure pushed it to disk with prefetch off and on (issue #29).

A tiny qwen3_5 checkpoint (kapitsa.testing.tiny, all layers full attention with 4 KV heads of 64)
runs through `InProcessEngine`, the path `kapitsa run` and `kapitsa serve` use. Turns 1..N replay an agent conversation (a long system prompt of tool
rules, short user steps, greedy replies of `--reply` tokens). Then a sub-agent request arrives whose
reservation (a large max_tokens) does not fit next to the prefix cache (the engine's memory limit
is set just above it), so admission spills the conversation to the disk tier; it ends at its first
token (a forced token that is also its stop string). The file cache's pages of the spilled files
are dropped (posix_fadvise DONTNEED), the engine idles `--idle-s` (the user reading the reply), and
turn N+1 arrives. Cold: the same turn N+1 prompt on an engine without a prefix cache. Besides the
time to first token, the script times the prefix-cache lookup itself, where the engine thread reads
a file when nothing read it ahead: on a loaded machine that is the part prefetch changes that noise
does not drown.

With `--shape 4b` the model is a random-weight 4-bit checkpoint of that real shape
(lab/shape_checkpoint.py: the tiny test tokenizer, replies always plain text), the prefix cache
`--cache-mib` (default 2048: a real shape's conversation holds hundreds of MB of K/V and recurrent
checkpoints) and the sub-agent's reservation twice that, so the turns fit beside the cache and the
sub-agent does not. Each run prints a JSON line as it ends (a cut run still reports).

    .venv/bin/python lab/prefetch_ttft.py            # 8-turn replay, 7 repeats: medians and minima
    .venv/bin/python lab/prefetch_ttft.py --tiny     # seconds-long smoke run
    python lab/prefetch_ttft.py --shape 4b --turns 6 --reply 16 --repeats 3 --idle-s 2   # the H200
    .venv/bin/python lab/prefetch_ttft.py --shape 4b --tiny   # the same path at tiny widths
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from kapitsa.engine.cache.prefix import PrefixCache
from kapitsa.engine.inprocess import InProcessEngine
from kapitsa.engine.loading.loader import load_model
from kapitsa.engine.options import EngineConfig
from kapitsa.engine.types import ErrorEvent, FinishEvent, GenerationRequest, SamplingParams, TokenEvent
from kapitsa.testing.tiny import write_tiny_checkpoint
from lab.engine_timing import emit
from lab.models_under_test import DTYPE, SHAPES
from lab.shape_checkpoint import write_shape_checkpoint

MIB = 2**20
LOOKUP_MS: list[float] = []  # every PrefixCache.lookup's own time (the engine thread's file read, if any)
SUB_AGENT_TOKENS = 16384  # the sub-agent's max_tokens at least: what its admission reserves
# Every layer full attention, 4 KV heads of 64: 8 KiB of float32 K/V per token, so a conversation's
# checkpoint file is tens of MB and reading it is more than the machine's noise.
WIDE_KV = {"full_attention_interval": 1, "num_key_value_heads": 4, "head_dim": 64}
# `--hybrid`: Qwen3.5's own layout (three Gated DeltaNet layers to one attention layer) at the same
# K/V width: its recurrent state makes every message boundary end a prefill chunk.
HYBRID = {**WIDE_KV, "full_attention_interval": 4, "num_hidden_layers": 8}


def _time_lookups() -> None:
    lookup = PrefixCache.lookup

    def timed(self, tokens):  # noqa: ANN001, ANN202
        t0 = time.perf_counter()
        try:
            return lookup(self, tokens)
        finally:
            LOOKUP_MS.append((time.perf_counter() - t0) * 1e3)

    PrefixCache.lookup = timed  # type: ignore[method-assign]


async def _ask(client, request) -> tuple[float, str, FinishEvent]:
    t0, first, text, finish = time.perf_counter(), 0.0, "", None
    async for event in client.generate(request):
        if isinstance(event, TokenEvent):
            first = first or time.perf_counter() - t0
            text += event.text
        elif isinstance(event, FinishEvent):
            finish = event
        elif isinstance(event, ErrorEvent):
            raise event.error
    return first, text, finish


def _system_prompt(rules: int) -> str:
    return "You are a coding agent with these tools and rules.\n" + "".join(
        f"Rule {i}: read files with read_file(path), edit with edit_file(path, old, new); cite paths.\n"
        for i in range(rules)
    )


def _sub_agent(loaded, tokens: int) -> GenerationRequest:
    x = loaded.tokenizer.encode("x")[-1]
    sampling = SamplingParams(max_tokens=tokens, logit_bias=((x, 100.0),), stop=("x",))
    return GenerationRequest(prompt="Summarize the repository.", sampling=sampling)


def _drop_page_cache(folder: Path) -> None:
    for path in folder.rglob("*.safetensors"):
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _sub_agent_reserve(loaded, cache_bytes: int) -> tuple[int, int]:
    """The sub-agent's max_tokens and the bytes its admission reserves: K/V of at least twice the
    prefix cache, so the turns (a few thousand tokens) fit beside a full cache and it does not; at
    most half the context window, which the engine would clamp it to (a smaller reservation)."""
    gc.collect()
    sizes = InProcessEngine.from_loaded(loaded, config=EngineConfig(prefix_cache_bytes=0))
    memory = sizes.engine.memory
    tokens = max(SUB_AGENT_TOKENS, -(-2 * cache_bytes // max(1, memory.sizes.kv_bytes_per_token)))
    tokens = min(tokens, loaded.info.context_length // 2)
    reserve = memory.sequence_bytes(tokens + 16)
    sizes.close()
    del sizes
    gc.collect()
    return tokens, reserve


def _engine(loaded, args, *, disk: Path | None, prefetch: bool, cache: bool = True) -> InProcessEngine:
    gc.collect()
    config = EngineConfig(
        prefill_chunk=512,
        prefix_cache_bytes=args.cache_mib * MIB if cache else 0,
        memory_limit_bytes=mx.get_active_memory() + args.reserve_bytes + MIB // 4,
        disk_cache_dir=disk,
        model_key="prefetch-bench",
        prefetch=prefetch,
    )
    return InProcessEngine.from_loaded(loaded, config=config)


async def _replay(loaded, args, *, mode: str, folder: Path) -> dict:
    """One run: turns 1..N, the sub-agent (unless mode is "memory"), idle, then turn N+1."""
    disk = None if mode == "memory" else folder / mode
    client = _engine(loaded, args, disk=disk, prefetch=mode != "disk-prefetch-off")
    sampling = SamplingParams(max_tokens=args.reply)
    messages = [{"role": "system", "content": _system_prompt(args.rules)}]
    for turn in range(args.turns):
        messages.append({"role": "user", "content": f"Step {turn}: run the tests and fix what fails."})
        _, text, _ = await _ask(client, GenerationRequest(messages=tuple(messages), sampling=sampling))
        messages.append({"role": "assistant", "content": text})
    if disk is not None:
        await _ask(client, _sub_agent(loaded, args.sub_agent_tokens))
        _drop_page_cache(disk)
    await asyncio.sleep(args.idle_s)
    stats_before = client.stats()
    messages.append({"role": "user", "content": f"Step {args.turns}: run the tests and fix what fails."})
    request = GenerationRequest(messages=tuple(messages), sampling=sampling)
    LOOKUP_MS.clear()
    ttft, _, finish = await _ask(client, request)
    stats = client.stats()
    client.close()
    return {
        "ttft_s": ttft,
        "lookup_ms": sum(LOOKUP_MS),
        "prompt_tokens": finish.usage.prompt_tokens,
        "cached_tokens": finish.usage.cached_tokens,
        "preloaded": stats_before.checkpoints_preloaded,
        "loaded_at_lookup": stats.checkpoints_loaded_from_disk - stats_before.checkpoints_loaded_from_disk,
        "read_ahead": stats.checkpoints_read_ahead,
        "request": request,
    }


async def _cold(loaded, args, request) -> float:
    client = _engine(loaded, args, disk=None, prefetch=False, cache=False)
    await _ask(client, GenerationRequest(prompt="warm up", sampling=SamplingParams(max_tokens=2)))
    ttft, _, _ = await _ask(client, request)
    client.close()
    return ttft


async def main(args) -> None:
    modes = ("memory", "disk-prefetch-off", "disk-prefetch-on")
    _time_lookups()
    with tempfile.TemporaryDirectory() as tmp:
        loaded = load_model(_checkpoint(args, Path(tmp) / "ckpt"))
        args.sub_agent_tokens, args.reserve_bytes = _sub_agent_reserve(loaded, args.cache_mib * MIB)
        emit(
            {
                "phase": "loaded",
                "shape": args.shape or ("tiny-hybrid" if args.hybrid else "tiny-wide-kv"),
                "sub_agent_tokens": args.sub_agent_tokens,
                "reserve_mib": round(args.reserve_bytes / MIB, 1),
                "cache_mib": args.cache_mib,
            }
        )
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        colds = []
        for repeat in range(args.repeats):
            for mode in modes:  # interleaved, so drift in the machine's load hits every mode alike
                row = await _replay(loaded, args, mode=mode, folder=Path(tmp) / f"r{repeat}")
                runs[mode].append(row)
                _emit_run(mode, repeat, row)
            colds.append(await _cold(loaded, args, runs["memory"][-1]["request"]))
            emit({"phase": "run", "mode": "cold", "repeat": repeat, "ttft_ms": round(colds[-1] * 1e3, 1)})
    cold, cold_min = statistics.median(colds), min(colds)
    print(f"turns {args.turns}, prompt of turn N+1: {runs['memory'][0]['prompt_tokens']} tokens")
    print(f"cold TTFT median {cold * 1e3:.1f} ms, min {cold_min * 1e3:.1f} ms (runs {_ms(colds)})")
    for mode in modes:
        ttfts = [r["ttft_s"] for r in runs[mode]]
        median, least = statistics.median(ttfts), min(ttfts)
        lookups = [r["lookup_ms"] for r in runs[mode]]
        last = runs[mode][-1]
        print(
            f"{mode:18} TTFT median {median * 1e3:6.1f} ms = {median / cold:5.1%} of cold, min {least * 1e3:6.1f} ms"
            f" = {least / cold_min:5.1%} of cold's min (runs {_ms(ttfts)}); the lookup itself: median"
            f" {statistics.median(lookups):.1f} ms (runs {', '.join(f'{x:.1f}' for x in lookups)}); last run: cached"
            f" {last['cached_tokens']}/{last['prompt_tokens']}, preloaded {last['preloaded']}, loaded at lookup"
            f" {last['loaded_at_lookup']}, read ahead {last['read_ahead']}"
        )


def _checkpoint(args, folder: Path) -> Path:
    """The model's folder: the tiny full-attention Qwen3.5, or `--shape`'s random 4-bit checkpoint."""
    if args.shape is None:
        return write_tiny_checkpoint(folder, "qwen3_5", **(HYBRID if args.hybrid else WIDE_KV))
    write_shape_checkpoint(args.shape, folder, tiny=args.tiny)
    size = sum(p.stat().st_size for p in folder.iterdir())
    emit({"phase": "checkpoint", "shape": args.shape, "tiny": args.tiny, "gb": round(size / 1e9, 2)})
    return folder


def _emit_run(mode: str, repeat: int, row: dict) -> None:
    counts = {
        k: row[k] for k in ("prompt_tokens", "cached_tokens", "preloaded", "loaded_at_lookup", "read_ahead")
    }
    timings = {"ttft_ms": round(row["ttft_s"] * 1e3, 1), "lookup_ms": round(row["lookup_ms"], 2)}
    emit({"phase": "run", "mode": mode, "repeat": repeat, **timings, **counts})


def _ms(seconds: list[float]) -> str:
    return ", ".join(f"{s * 1e3:.0f}" for s in seconds) + " ms"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=8, help="turns before the measured one (N)")
    parser.add_argument("--rules", type=int, default=40, help="system prompt lines (~24 tokens each)")
    parser.add_argument("--reply", type=int, default=32, help="tokens per reply")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--idle-s", type=float, default=0.5, help="idle time before turn N+1")
    parser.add_argument("--shape", choices=sorted(SHAPES), help="a real shape's random 4-bit checkpoint")
    parser.add_argument("--hybrid", action="store_true", help="the tiny model with Qwen3.5's 3:1 GDN layout")
    parser.add_argument("--cache-mib", type=int, help="prefix cache size (default 64, with --shape 2048)")
    parser.add_argument(
        "--tiny", action="store_true", help="a seconds-long smoke run (--shape: at tiny widths)"
    )
    args = parser.parse_args()
    if args.cache_mib is None:
        args.cache_mib = 2048 if args.shape and not args.tiny else 64
    if args.tiny:
        args.turns, args.rules, args.reply, args.repeats = 3, 8, 8, 1
        DTYPE["value"] = mx.float32  # as shape_checkpoint --tiny: MLX's CPU gather_mm (MoE) is float32-only
    asyncio.run(main(args))
