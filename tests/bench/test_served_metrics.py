"""The bench reads a kapitsa server's speculation from its `/metrics`, and leaves other servers' alone."""

from __future__ import annotations

from dataclasses import replace

from kapitsa.bench.runner import run_bench
from kapitsa.bench.schema import EngineResult
from kapitsa.bench.targets import HttpTarget, ServedMetrics, parse_kapitsa_metrics
from kapitsa.bench.workloads import BenchConfig
from kapitsa.engine.types import EngineStats
from kapitsa.server.metrics import prometheus_text
from kapitsa.testing.fake_engine import FakeEngine
from tests.server.server_harness import live_server

SMALL = BenchConfig(
    short_prompt_words=8,
    long_prompt_words=32,
    decode_tokens=4,
    replay_turns=2,
    replay_context_words=16,
    concurrent_tokens=4,
)


class SpeculatingFake(FakeEngine):
    def stats(self) -> EngineStats:
        return replace(super().stats(), speculative="ngram", draft_acceptance_rate=0.375)


def test_parses_what_the_server_writes() -> None:
    text = prometheus_text(
        EngineStats(model='a "quoted" model', speculative="auto", draft_acceptance_rate=0.5)
    )
    assert parse_kapitsa_metrics(text) == ServedMetrics(speculative="auto", draft_acceptance_rate=0.5)


def test_other_servers_metrics_are_not_kapitsas() -> None:
    assert parse_kapitsa_metrics("# TYPE vllm_num_requests gauge\nvllm_num_requests 0\n") is None
    assert parse_kapitsa_metrics("<html>not found</html>") is None


async def _bench(url: str) -> EngineResult:
    target = HttpTarget(url)
    await target.prepare()
    try:
        return await run_bench(target, SMALL)
    finally:
        await target.aclose()


async def test_speculation_measured_through_a_live_server() -> None:
    with live_server(SpeculatingFake()) as server:
        result = await _bench(server.v1)
    spec = result.workload("speculative")
    assert result.speculative == "ngram"
    assert spec.status == "ok" and spec.metrics["acceptance_pct"] == 37.5
    assert spec.note == "mode: ngram; acceptance over the server's lifetime"


async def test_a_server_that_does_not_speculate_is_reported_off() -> None:
    with live_server(FakeEngine()) as server:
        result = await _bench(server.url)
    assert result.workload("speculative").status == "skipped"
    assert result.workload("speculative").note == "speculative decoding is off"
