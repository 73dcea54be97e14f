"""The runner against the scripted `FakeEngine`: every workload, its metrics, and failures as values."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kapitsa.bench.runner import WORKLOAD_NAMES, check_workloads, decode_rate, prefill_rate, run_bench
from kapitsa.bench.schema import WORKLOAD_METRICS
from kapitsa.bench.targets import EngineTarget, StreamResult
from kapitsa.bench.workloads import BenchConfig, agent_replay_prefixes
from kapitsa.engine.types import EngineStats
from kapitsa.errors import EngineBusy
from kapitsa.testing.fake_engine import FakeEngine

SMALL = BenchConfig(
    short_prompt_words=8,
    long_prompt_words=64,
    decode_tokens=8,
    replay_turns=3,
    replay_context_words=32,
    concurrent_tokens=8,
)


async def test_every_workload_runs_in_order_with_its_metrics() -> None:
    seen: list[str] = []
    result = await run_bench(
        EngineTarget(FakeEngine()), SMALL, on_progress=lambda name, i, n: seen.append(name)
    )
    assert seen == list(WORKLOAD_NAMES)
    assert [w.name for w in result.workloads] == list(WORKLOAD_NAMES)
    for workload in result.workloads:
        assert set(workload.metrics) <= set(WORKLOAD_METRICS[workload.name])
    assert result.model == "fake" and result.kind == "in-process"
    assert result.workload("decode_short").metrics["completion_tokens"] == 8  # max_tokens cut the reply
    assert result.workload("decode_short").metrics["decode_tok_s"] > 0
    assert result.workload("concurrent_4").metrics["streams"] == 4


async def test_agent_replay_hit_rate_comes_from_reported_cached_tokens(monkeypatch) -> None:
    monkeypatch.setattr("kapitsa.bench.runner.nonce", lambda: "[n]")
    engine = FakeEngine()
    target = EngineTarget(engine)
    prefixes = agent_replay_prefixes(
        SMALL.replay_turns, context_words=SMALL.replay_context_words, run_nonce="[n]"
    )
    sizes = [await engine.count_tokens(_req(p)) for p in prefixes]
    for _ in range(7):  # the warm-up, decode_short, decode_long, prefill, cold, warm; replay turn 1: none
        engine.enqueue("x y")
    for size in sizes[1:]:
        engine.enqueue("x y", cached_tokens=size // 2)
    result = await run_bench(target, SMALL)
    replay = result.workload("agent_replay").metrics
    assert replay["turns"] == 3
    assert replay["prompt_tokens"] == sum(sizes)
    assert replay["cached_tokens"] == sum(s // 2 for s in sizes[1:])
    assert replay["cache_hit_pct"] == round(100 * replay["cached_tokens"] / sum(sizes), 4)


async def test_a_failing_workload_is_reported_and_the_rest_still_run() -> None:
    engine = FakeEngine()
    engine.enqueue("hello")  # the untimed warm-up's
    engine.enqueue_error(EngineBusy("out of memory for this prompt"))
    result = await run_bench(EngineTarget(engine), SMALL)
    first = result.workload("decode_short")
    assert first.status == "error" and "out of memory" in first.note
    assert result.workload("decode_long").status == "ok"


async def test_speculative_is_skipped_when_off_and_measured_when_on() -> None:
    off = await run_bench(EngineTarget(FakeEngine()), SMALL)
    assert off.workload("speculative").status == "skipped"
    assert off.speculative == "none"

    class SpeculatingFake(FakeEngine):
        def stats(self) -> EngineStats:
            return replace(super().stats(), speculative="ngram")

    on = await run_bench(EngineTarget(SpeculatingFake()), SMALL)
    spec = on.workload("speculative")
    assert spec.status == "ok" and spec.note == "mode: ngram; the engine reported no drafted tokens"
    assert spec.metrics["draft_tokens_proposed"] == 0 and spec.metrics["acceptance_pct"] is None


def test_rates_exclude_cached_tokens_and_time_decode_by_the_clients_clock() -> None:
    r = StreamResult(prompt_tokens=1000, completion_tokens=101, cached_tokens=600, ttft_s=0.5, total_s=1.5)
    assert decode_rate(r) == 100.0  # (101 - 1) tokens over the 1 s after the first
    assert prefill_rate(r) == 800.0  # 400 computed tokens in 0.5 s
    timed = replace(r, prefill_s=0.25, decode_s=2.0)  # the engine's timers: prefill's is used
    assert decode_rate(timed) == 100.0 and prefill_rate(timed) == 1600.0
    assert decode_rate(replace(r, completion_tokens=1)) is None
    assert prefill_rate(replace(r, prompt_tokens=None)) is None


def _req(messages):
    from kapitsa.engine.types import GenerationRequest

    return GenerationRequest(messages=tuple(messages))


async def test_a_chosen_subset_runs_in_the_standard_order() -> None:
    seen: list[str] = []
    result = await run_bench(
        EngineTarget(FakeEngine()),
        SMALL,
        on_progress=lambda name, i, n: seen.append((name, i, n)),
        workloads=("concurrent_4", "decode_short", "decode_short"),
    )
    assert seen == [("decode_short", 0, 2), ("concurrent_4", 1, 2)]
    assert [w.name for w in result.workloads] == ["decode_short", "concurrent_4"]


def test_unknown_or_no_workloads_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="unknown workload decode_fast; choose from decode_short"):
        check_workloads(["decode_fast"])
    with pytest.raises(ValueError, match="no workload chosen"):
        check_workloads([])


async def test_an_untimed_warm_up_request_comes_before_the_workloads() -> None:
    """The first workload must not time a target's first-use work: one short request goes first,
    and none when `warmup_tokens` is 0."""
    engine = FakeEngine()
    engine.enqueue_error(EngineBusy("the warm-up's failure is left to the workloads"))
    result = await run_bench(EngineTarget(engine), SMALL)
    assert result.workload("decode_short").status == "ok"
    cold = FakeEngine()
    cold.enqueue_error(EngineBusy("first request"))
    result = await run_bench(EngineTarget(cold), replace(SMALL, warmup_tokens=0))
    assert result.workload("decode_short").status == "error"
