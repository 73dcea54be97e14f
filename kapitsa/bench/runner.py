"""Runs the standard workloads against one `BenchTarget` and returns an `EngineResult`.

A failing workload becomes an "error" entry with the message; the other workloads still run.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

from kapitsa.bench.schema import EngineResult, Metric, WorkloadResult
from kapitsa.bench.targets import BenchTarget, StreamResult
from kapitsa.bench.workloads import BenchConfig, agent_replay_prefixes, nonce, single_turn

ProgressCallback = Callable[[str, int, int], None]  # (workload name, index, total)
ResultCallback = Callable[[WorkloadResult, int, int], None]  # (finished workload, index, total)

WORKLOAD_NAMES = (
    "decode_short",
    "decode_long",
    "prefill",
    "ttft_cold_warm",
    "agent_replay",
    "concurrent_4",
    "speculative",
)


async def run_bench(
    target: BenchTarget,
    config: BenchConfig,
    *,
    on_progress: ProgressCallback | None = None,
    on_result: ResultCallback | None = None,
    workloads: tuple[str, ...] = WORKLOAD_NAMES,
) -> EngineResult:
    """Run `workloads` (default: every one) in their standard order against `target`;
    `on_progress` before each, `on_result` after."""
    chosen = check_workloads(workloads)
    seen: list[StreamResult] = []  # every completion, for the speculative totals
    steps: dict[str, Callable[[], Awaitable[WorkloadResult]]] = {
        "decode_short": lambda: _decode(
            target, config, seen, name="decode_short", words=config.short_prompt_words
        ),
        "decode_long": lambda: _decode(
            target, config, seen, name="decode_long", words=config.long_prompt_words
        ),
        "prefill": lambda: _prefill(target, config, seen),
        "ttft_cold_warm": lambda: _ttft_cold_warm(target, config, seen),
        "agent_replay": lambda: _agent_replay(target, config, seen),
        "concurrent_4": lambda: _concurrent(target, config, seen),
        "speculative": lambda: _speculative(target, seen),
    }
    steps = {name: step for name, step in steps.items() if name in chosen}
    result = EngineResult(name=target.name, kind=target.kind, model=target.model, url=target.url)
    await _warm_up(target, config.warmup_tokens)
    for index, (name, step) in enumerate(steps.items()):
        if on_progress:
            on_progress(name, index, len(steps))
        result.workloads.append(await _guarded(name, step))
        if on_result:
            on_result(result.workloads[-1], index, len(steps))
    result.speculative = target.speculative()
    return result


def check_workloads(names: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """`names` in the standard order, without repeats; ValueError names any unknown one."""
    unknown = [n for n in names if n not in WORKLOAD_NAMES]
    if unknown:
        raise ValueError(f"unknown workload {', '.join(unknown)}; choose from {', '.join(WORKLOAD_NAMES)}")
    if not names:
        raise ValueError(f"no workload chosen; choose from {', '.join(WORKLOAD_NAMES)}")
    return tuple(n for n in WORKLOAD_NAMES if n in names)


async def _warm_up(target: BenchTarget, tokens: int) -> None:
    """One untimed short request. A failure is left to the workloads, which report their own."""
    if tokens:
        with contextlib.suppress(Exception):  # the timed workloads meet the same failure and say so
            await target.complete(single_turn(8, seed=0, run_nonce=nonce()), max_tokens=tokens)


async def _guarded(name: str, step: Callable[[], Awaitable[WorkloadResult]]) -> WorkloadResult:
    try:
        return await step()
    except Exception as err:  # noqa: BLE001 - one workload's failure must not end the bench
        return WorkloadResult(name=name, status="error", note=f"{type(err).__name__}: {err}")


async def _complete(
    target: BenchTarget, seen: list[StreamResult], messages: list, max_tokens: int
) -> StreamResult:
    result = await target.complete(messages, max_tokens=max_tokens)
    seen.append(result)
    return result


async def _decode(
    target: BenchTarget, config: BenchConfig, seen: list[StreamResult], *, name: str, words: int
) -> WorkloadResult:
    messages = single_turn(words, seed=1, run_nonce=nonce())
    r = await _complete(target, seen, messages, config.decode_tokens)
    metrics = {
        "decode_tok_s": decode_rate(r),
        "ttft_s": _round(r.ttft_s),
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
    }
    return WorkloadResult(name=name, metrics=metrics)


async def _prefill(target: BenchTarget, config: BenchConfig, seen: list[StreamResult]) -> WorkloadResult:
    messages = single_turn(config.long_prompt_words, seed=2, run_nonce=nonce())
    r = await _complete(target, seen, messages, 1)
    metrics = {"prefill_tok_s": prefill_rate(r), "ttft_s": _round(r.ttft_s), "prompt_tokens": r.prompt_tokens}
    return WorkloadResult(name="prefill", metrics=metrics)


async def _ttft_cold_warm(
    target: BenchTarget, config: BenchConfig, seen: list[StreamResult]
) -> WorkloadResult:
    messages = single_turn(config.long_prompt_words, seed=3, run_nonce=nonce())
    cold = await _complete(target, seen, messages, 1)
    warm = await _complete(target, seen, messages, 1)
    speedup = cold.ttft_s / warm.ttft_s if warm.ttft_s > 0 else None
    metrics = {
        "ttft_cold_s": _round(cold.ttft_s),
        "ttft_warm_s": _round(warm.ttft_s),
        "warm_speedup": _round(speedup),
        "cached_tokens_warm": warm.cached_tokens,
        "prompt_tokens": cold.prompt_tokens,
    }
    return WorkloadResult(name="ttft_cold_warm", metrics=metrics)


async def _agent_replay(target: BenchTarget, config: BenchConfig, seen: list[StreamResult]) -> WorkloadResult:
    prefixes = agent_replay_prefixes(
        config.replay_turns, context_words=config.replay_context_words, run_nonce=nonce()
    )
    turns = [await _complete(target, seen, messages, 16) for messages in prefixes]
    prompt_total = _sum_known([t.prompt_tokens for t in turns])
    cached_total = _sum_known([t.cached_tokens for t in turns])
    hit_pct = 100.0 * cached_total / prompt_total if prompt_total and cached_total is not None else None
    metrics = {
        "cache_hit_pct": _round(hit_pct),
        "turns": len(turns),
        "prompt_tokens": prompt_total,
        "cached_tokens": cached_total,
        "mean_ttft_s": _round(sum(t.ttft_s for t in turns) / len(turns)),
    }
    note = None if cached_total is not None else "the endpoint does not report cached prompt tokens"
    return WorkloadResult(name="agent_replay", metrics=metrics, note=note)


async def _concurrent(target: BenchTarget, config: BenchConfig, seen: list[StreamResult]) -> WorkloadResult:
    prompts = [
        single_turn(config.short_prompt_words, seed=4 + i, run_nonce=nonce())
        for i in range(config.concurrent_streams)
    ]
    started = time.perf_counter()
    results = await asyncio.gather(*(_complete(target, seen, p, config.concurrent_tokens) for p in prompts))
    wall_s = time.perf_counter() - started
    completion = sum(r.completion_tokens for r in results)
    metrics = {
        "aggregate_tok_s": _round(completion / wall_s if wall_s > 0 else None),
        "streams": len(results),
        "completion_tokens": completion,
        "wall_s": _round(wall_s),
    }
    return WorkloadResult(name="concurrent_4", metrics=metrics)


async def _speculative(target: BenchTarget, seen: list[StreamResult]) -> WorkloadResult:
    mode = target.speculative()
    if mode is None:
        return WorkloadResult(
            name="speculative", status="skipped", note="the endpoint does not report speculative decoding"
        )
    if mode == "none":
        return WorkloadResult(name="speculative", status="skipped", note="speculative decoding is off")
    proposed = _sum_known([r.draft_proposed for r in seen])
    if proposed is None:  # an HTTP endpoint: no per-request counts, only the server's lifetime rate
        rate = await target.acceptance_rate()
        metrics = {"acceptance_pct": _round(None if rate is None else 100.0 * rate)}
        return WorkloadResult(
            name="speculative", metrics=metrics, note=f"mode: {mode}; acceptance over the server's lifetime"
        )
    accepted = _sum_known([r.draft_accepted for r in seen]) or 0
    pct = 100.0 * accepted / proposed if proposed else None
    metrics = {
        "acceptance_pct": _round(pct),
        "draft_tokens_proposed": proposed,
        "draft_tokens_accepted": accepted,
    }
    note = f"mode: {mode}" if proposed else f"mode: {mode}; the engine reported no drafted tokens"
    return WorkloadResult(name="speculative", metrics=metrics, note=note)


def decode_rate(r: StreamResult) -> Metric:
    """Generated tokens per second after the first, by the client's clock: an in-process engine and
    a server are timed alike (the engine's own timer starts at its prefill's end, before the first
    token reaches anyone, and counts that token too)."""
    span = r.total_s - r.ttft_s
    return _round((r.completion_tokens - 1) / span) if r.completion_tokens > 1 and span > 0 else None


def prefill_rate(r: StreamResult) -> Metric:
    """Prompt tokens actually computed (not served from cache) per second of prefill."""
    if r.prompt_tokens is None:
        return None
    computed = r.prompt_tokens - (r.cached_tokens or 0)
    seconds = r.prefill_s or r.ttft_s
    return _round(computed / seconds) if seconds > 0 else None


def _sum_known(values: list[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
