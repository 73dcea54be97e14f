"""The versioned report schema, the text table, saving, and `--submit` against a local receiver."""

from __future__ import annotations

import json

import pytest

from kapitsa.bench.render import HEADLINE, render_text
from kapitsa.bench.runner import run_bench
from kapitsa.bench.schema import SCHEMA_VERSION, WORKLOAD_METRICS, BenchReport, report_from_dict
from kapitsa.bench.submit import save_report, submit_report
from kapitsa.bench.targets import EngineTarget
from kapitsa.bench.workloads import BenchConfig
from kapitsa.errors import InvalidRequest, KapitsaError
from kapitsa.testing.fake_engine import FakeEngine

SMALL = BenchConfig(
    short_prompt_words=8,
    long_prompt_words=32,
    decode_tokens=4,
    replay_turns=2,
    replay_context_words=16,
    concurrent_tokens=4,
)


async def _report() -> BenchReport:
    engine_result = await run_bench(EngineTarget(FakeEngine()), SMALL)
    return BenchReport(
        machine={
            "os": "Linux",
            "arch": "x86_64",
            "chip": "test",
            "cpu_count": 2,
            "memory_bytes": 2**34,
            "mlx": "0.0",
            "mlx_backend": "cpu",
        },
        config=SMALL.to_dict(),
        engines=[engine_result],
    )


class TestSchema:
    async def test_round_trips_through_json(self) -> None:
        """A saved report parses back to the same dict."""
        data = json.loads(json.dumps((await _report()).to_dict()))
        assert data["schema"] == "kapitsa-bench" and data["schema_version"] == SCHEMA_VERSION
        assert report_from_dict(data).to_dict() == data

    @pytest.mark.parametrize(
        ("mutate", "message"),
        [
            (lambda d: d.update(schema="other"), "not a kapitsa-bench report"),
            (lambda d: d.update(schema_version=99), "unsupported schema_version"),
            (lambda d: d["engines"][0]["workloads"][0].update(name="bogus"), "unknown workload"),
            (
                lambda d: d["engines"][0]["workloads"][0]["metrics"].update(decode_tok_s="fast"),
                "number or null",
            ),
            (lambda d: d["engines"][0]["workloads"][0]["metrics"].update(made_up=1), "unknown metric"),
            (lambda d: d.pop("machine"), "malformed"),
        ],
    )
    async def test_rejects_malformed_reports(self, mutate, message: str) -> None:
        """Validation names what is wrong."""
        data = (await _report()).to_dict()
        mutate(data)
        with pytest.raises(InvalidRequest, match=message):
            report_from_dict(data)

    def test_headline_metrics_exist_in_the_schema(self) -> None:
        for workload, metric, _ in HEADLINE:
            assert metric in WORKLOAD_METRICS[workload]


async def test_text_table_has_one_column_per_engine() -> None:
    report = await _report()
    report.engines.append(report_from_dict(report.to_dict()).engines[0])
    report.engines[1].name = "other"
    text = render_text(report)
    header = text.splitlines()[2]
    assert "fake" in header and "other" in header
    assert "speculative decoding is off" in text  # skipped workloads explain themselves
    assert "test · 2 cores · 17.2 GB" in text  # 2**34 bytes, in the decimal GB used everywhere


class TestSubmit:
    async def test_posts_and_keeps_the_file(self, receiver, bench_dir) -> None:
        """The receiver gets the exact saved JSON."""
        report = await _report()
        path = save_report(report)
        assert path.parent == bench_dir
        result = submit_report(report, url=receiver.url, path=path)
        assert result.posted and "run-1" in result.message
        assert receiver.received == [json.loads(path.read_text())]

    async def test_offline_says_so_and_keeps_the_file(self, bench_dir) -> None:
        report = await _report()
        path = save_report(report)
        result = submit_report(report, url="http://127.0.0.1:9/results", path=path, timeout_s=2)
        assert not result.posted and result.message.startswith("offline") and str(path) in result.message
        assert path.exists()

    async def test_no_url_configured_is_not_an_error(self) -> None:
        report = await _report()
        path = save_report(report)
        result = submit_report(report, url=None, path=path)
        assert not result.posted and "KAPITSA_BENCH_RESULTS_URL" in result.message

    async def test_a_refusal_is_an_error_naming_the_status(self, receiver) -> None:
        report = await _report()
        report.engines[0].workloads[0].name = "bogus"  # the receiver validates and refuses it
        path = save_report(report)
        with pytest.raises(KapitsaError, match="400"):
            submit_report(report, url=receiver.url, path=path)
        assert path.exists()
