"""The bench against the real in-process engine on a tiny random Qwen3.5 checkpoint."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from kapitsa.bench.command import BenchOptions, collect_report
from kapitsa.bench.runner import WORKLOAD_NAMES
from kapitsa.bench.workloads import BenchConfig
from kapitsa.testing import tiny

TINY = BenchConfig(
    short_prompt_words=8,
    long_prompt_words=96,
    decode_tokens=6,
    replay_turns=3,
    replay_context_words=48,
    concurrent_tokens=4,
)


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny-qwen3_5", "qwen3_5")


async def test_every_workload_measures_the_real_engine(tiny_qwen: Path) -> None:
    """Check real counters: fixed decode lengths (EOS ignored), prefix-cache hits on the warm and replayed prompts."""
    report = await collect_report(BenchOptions(model=str(tiny_qwen)), TINY)
    (engine,) = report.engines
    assert engine.kind == "in-process" and engine.model == "tiny-qwen3_5"
    assert engine.speculative == "ngram"  # `auto`, the default, drafts by n-gram lookup here
    by_name = {w.name: w for w in engine.workloads}
    assert list(by_name) == list(WORKLOAD_NAMES)
    for name in WORKLOAD_NAMES:
        assert by_name[name].status == "ok", by_name[name].note
    assert by_name["decode_short"].metrics["completion_tokens"] == TINY.decode_tokens
    assert by_name["decode_long"].metrics["prompt_tokens"] > by_name["decode_short"].metrics["prompt_tokens"]
    assert by_name["prefill"].metrics["prefill_tok_s"] > 0
    warm = by_name["ttft_cold_warm"].metrics
    assert (
        warm["cached_tokens_warm"] > 0.5 * warm["prompt_tokens"]
    )  # the repeat is served from the prefix cache
    assert by_name["agent_replay"].metrics["cache_hit_pct"] > 20
    assert by_name["concurrent_4"].metrics["completion_tokens"] == 4 * TINY.concurrent_tokens
    assert by_name["speculative"].metrics["draft_tokens_proposed"] >= 0
    assert report.machine["cpu_count"] and report.config == TINY.to_dict() | {
        "workloads": list(WORKLOAD_NAMES)
    }


# Run in a process of its own: other tests' engines in a shared worker allocate at any time
_MEMORY_AFTER_CLOSE = """
import asyncio, sys, time
import mlx.core as mx
from kapitsa.bench.command import BenchOptions, collect_report
from kapitsa.bench.workloads import BenchConfig

config = BenchConfig(**eval(sys.argv[2]))
options = BenchOptions(model=sys.argv[1], workloads=("decode_short",))

def settled(limit):
    # on a loaded machine part of what close frees lands a moment after it returns (another
    # thread's last references go when it next runs), so the reading waits up to 2 s for it
    deadline = time.monotonic() + 2
    while mx.get_active_memory() > limit and time.monotonic() < deadline:
        time.sleep(0.01)
    return mx.get_active_memory()

async def main():
    await collect_report(options, config)  # what a process keeps after its first engine (kernel probes)
    mx.clear_cache()
    before = settled(64 * 1024)
    await collect_report(options, config)
    print(before, settled(before + 64 * 1024), mx.get_cache_memory())

asyncio.run(main())
"""


def test_the_closed_engine_hands_its_memory_back(tiny_qwen: Path) -> None:
    """A bench that times servers after its own engine shares the device with them: once the
    in-process engine's workloads end, its model and caches are freed and MLX's cache is empty."""
    script = [sys.executable, "-c", _MEMORY_AFTER_CLOSE, str(tiny_qwen), repr(TINY.to_dict())]
    done = subprocess.run(script, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    before, after, cached = map(int, done.stdout.split()[-3:])
    assert cached == 0
    assert after <= before + 64 * 1024  # the tiny model alone holds ~1 MB


async def test_the_local_engine_is_opened_warmed_as_serve_opens_one(tiny_qwen: Path, monkeypatch) -> None:
    """The bench times what a server's clients get: its engine is opened with serve's idle warm-up
    and the workloads wait for it, not the one-time compiles a first process would pay."""
    from kapitsa import opener
    from kapitsa.bench import local

    asked, pending = [], [2, 1, 0]

    real = opener.open_engine

    def spy(ref, **kwargs):
        asked.append(kwargs.get("warm_batches"))
        return real(ref, **kwargs)

    monkeypatch.setattr(opener, "open_engine", spy)
    async with local.open_local_engine(str(tiny_qwen)) as client:
        assert asked == [True]
        stats = type(client).stats
        monkeypatch.setattr(
            type(client),
            "stats",
            lambda self: dataclasses.replace(stats(self), warm_batches_pending=pending.pop(0)),
        )
        monkeypatch.setattr(local, "POLL_S", 0.001)
        assert await local.until_warm(client) >= 0 and pending == []
        monkeypatch.setattr(  # a warm-up that never ends holds the workloads back for its limit only
            type(client), "stats", lambda self: dataclasses.replace(stats(self), warm_batches_pending=1)
        )
        assert 0.02 <= await local.until_warm(client, limit_s=0.02) < 5
