"""How bench output looks: one precision per metric, rich on a terminal and plain when piped, and
progress with an ETA and each workload's figures as soon as it finishes."""

from __future__ import annotations

import io
import re
import sys

import pytest

from kapitsa.bench.command import print_report
from kapitsa.bench.progress import BenchProgress, EtaClock, format_eta
from kapitsa.bench.render import HEADLINE, format_metric, render_text, table_rows
from kapitsa.bench.runner import WORKLOAD_NAMES, run_bench
from kapitsa.bench.schema import BenchReport, EngineResult, WorkloadResult
from kapitsa.bench.targets import EngineTarget
from kapitsa.bench.workloads import BenchConfig
from kapitsa.testing.fake_engine import FakeEngine

TINY = BenchConfig(
    short_prompt_words=4,
    long_prompt_words=16,
    decode_tokens=2,
    replay_turns=2,
    replay_context_words=8,
    concurrent_tokens=2,
)


def _engine(name: str, decode: float, ttft: float, hit: float) -> EngineResult:
    return EngineResult(
        name=name,
        kind="http",
        model=None,
        workloads=[
            WorkloadResult("decode_short", metrics={"decode_tok_s": decode, "ttft_s": ttft}),
            WorkloadResult("ttft_cold_warm", metrics={"ttft_cold_s": ttft, "ttft_warm_s": 9.214}),
            WorkloadResult("agent_replay", metrics={"cache_hit_pct": hit}),
            WorkloadResult("speculative", status="skipped", note="speculative decoding is off"),
        ],
    )


def _report() -> BenchReport:
    machine = {
        "chip": "test",
        "cpu_count": 2,
        "memory_bytes": 2**34,
        "os": "Linux",
        "mlx": "0",
        "mlx_backend": "cpu",
    }
    return BenchReport(
        machine=machine, config={}, engines=[_engine("a", 12.5, 1.611, 50.0), _engine("b", 9.214, 12.5, 7)]
    )


def _decimals(text: str) -> int:
    return len(text.partition(".")[2])


def test_each_metric_row_has_one_precision() -> None:
    """12.5 / 9.214 / 1.611 used to mix; now tok/s and % have 1 decimal, seconds 2, ratios 2."""
    rows = {row[0]: row[1:] for row in table_rows(_report())}
    assert rows["decode tok/s (short prompt)"] == ["12.5", "9.2"]
    assert rows["TTFT cold (s)"] == ["1.61", "12.50"]
    assert rows["TTFT warm (s)"] == ["9.21", "9.21"]
    assert rows["agent replay cache hit %"] == ["50.0", "7.0"]
    assert format_metric("warm_speedup", 3.14159) == "3.14" and format_metric("prompt_tokens", 120) == "120"


async def test_a_real_run_keeps_one_precision_per_row() -> None:
    engines = [await run_bench(EngineTarget(FakeEngine()), TINY) for _ in range(2)]
    for label, *cells in table_rows(BenchReport(machine={}, config={}, engines=engines))[1:]:
        figures = [c for c in cells if re.fullmatch(r"[\d.]+", c)]
        assert len({_decimals(c) for c in figures}) <= 1, (label, cells)


def test_piped_output_is_the_plain_table(capsys: pytest.CaptureFixture[str]) -> None:
    print_report(_report(), json_out=False)
    out = capsys.readouterr().out
    assert out == render_text(_report()) + "\n" and "\x1b[" not in out


def test_a_terminal_gets_a_rich_table_in_colour(capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    monkeypatch.setenv("TERM", "xterm-256color")
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("FORCE_COLOR", "1")
    print_report(_report(), json_out=False)
    out = capsys.readouterr().out
    assert "\x1b[" in out and ("│" in out or "┃" in out)
    assert "12.5" in out and "9.2" in out and "speculative decoding is off" in out


def test_json_out_stays_json_on_a_terminal(capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    import json

    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    print_report(_report(), json_out=True)
    assert json.loads(capsys.readouterr().out)["engines"][1]["name"] == "b"


def test_eta_is_the_mean_step_time_times_the_steps_left() -> None:
    clock = EtaClock(total_steps=7)
    assert clock.eta_s(now=5.0) is None  # nothing finished: no estimate
    clock.start(now=0.0)
    clock.step_done()
    clock.step_done()
    assert clock.eta_s(now=10.0) == pytest.approx(25.0)
    assert format_eta(25.0) == "ETA 25s" and format_eta(125.4) == "ETA 2m05s" and format_eta(None) == "ETA …"


async def _run_with_progress(stream: io.StringIO) -> list[str]:
    progress = BenchProgress(len(WORKLOAD_NAMES), stream=stream)
    try:
        await run_bench(
            EngineTarget(FakeEngine(), name="fake"),
            TINY,
            on_progress=lambda name, i, n: progress.started("fake", name, i, n),
            on_result=lambda result, _i, _n: progress.finished("fake", result),
        )
    finally:
        progress.close()
    return stream.getvalue().splitlines()


async def test_piped_progress_prints_plain_lines_with_eta_and_each_result_as_it_finishes() -> None:
    lines = await _run_with_progress(io.StringIO())
    assert lines[0] == "[fake] 1/7 decode_short · ETA …"  # one engine: no "overall" count
    assert lines[1].startswith("[fake] decode_short: decode_tok_s=")  # its figures before the next one starts
    assert re.fullmatch(r"\[fake\] 2/7 decode_long · ETA \d+s", lines[2])
    assert lines[-1] == "[fake] speculative: skipped (speculative decoding is off)"
    assert len(lines) == 2 * len(WORKLOAD_NAMES) and "\x1b[" not in "".join(lines)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


async def test_terminal_progress_is_a_rich_bar_that_still_prints_each_result() -> None:
    text = "\n".join(await _run_with_progress(_Terminal()))
    assert "[fake] decode_short: decode_tok_s=" in text and "[fake] concurrent_4: aggregate_tok_s=" in text
    assert "\x1b[" in text  # cursor control of the live bar


def test_the_table_has_rows_for_the_chosen_workloads_only() -> None:
    engine = EngineResult(name="kapitsa", kind="in-process", model="m", url=None)
    engine.workloads.append(WorkloadResult(name="decode_short", metrics={"decode_tok_s": 12.0}))
    chosen = BenchReport(machine={}, config={"workloads": ["decode_short", "agent_replay"]}, engines=[engine])
    assert [row[1:] for row in table_rows(chosen)[1:]] == [["12.0"], ["-"]]  # the replay has not run yet
    unsaid = BenchReport(machine={}, config={}, engines=[engine])
    assert len(table_rows(unsaid)) == 1 + len(HEADLINE)
