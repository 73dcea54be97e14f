"""`--compare` against a real `mlx_lm.server` serving a tiny checkpoint, and the CLI around it."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from kapitsa.bench.command import QUICK_CONFIG, BenchOptions, confirm_and_submit
from kapitsa.bench.runner import WORKLOAD_NAMES, run_bench
from kapitsa.bench.schema import BenchReport
from kapitsa.bench.submit import save_report
from kapitsa.bench.targets import EngineTarget, HttpTarget, normalize_base_url
from kapitsa.bench.workloads import BenchConfig
from kapitsa.cli import app
from kapitsa.errors import InvalidRequest
from kapitsa.testing.fake_engine import FakeEngine

TINY = BenchConfig(
    short_prompt_words=4,
    long_prompt_words=16,
    decode_tokens=2,
    replay_turns=2,
    replay_context_words=8,
    concurrent_tokens=2,
)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://127.0.0.1:8080", ("http://127.0.0.1:8080/v1", None)),
        ("http://127.0.0.1:8080/v1/", ("http://127.0.0.1:8080/v1", None)),
        ("http://h:1/v1#qwen3:8b", ("http://h:1/v1", "qwen3:8b")),
    ],
)
def test_base_url_and_model_from_the_compare_argument(url: str, expected: tuple) -> None:
    assert normalize_base_url(url) == expected


def test_rejects_a_non_http_url() -> None:
    with pytest.raises(InvalidRequest, match="not an http"):
        normalize_base_url("127.0.0.1:8080")


async def test_workloads_against_mlx_lm_server(mlx_lm_server: str) -> None:
    """Real numbers from a real server: mlx-lm reports usage and cached tokens, so everything but speculative is measured."""
    target = HttpTarget(mlx_lm_server)
    await target.prepare()
    try:
        result = await run_bench(target, QUICK_CONFIG)
    finally:
        await target.aclose()
    assert [w.name for w in result.workloads] == list(WORKLOAD_NAMES)
    by_name = {w.name: w for w in result.workloads}
    for name in WORKLOAD_NAMES[:-1]:
        assert by_name[name].status == "ok", by_name[name].note
    assert by_name["decode_short"].metrics["completion_tokens"] >= 1
    assert by_name["prefill"].metrics["prefill_tok_s"] > 0
    warm = by_name["ttft_cold_warm"].metrics
    assert warm["cached_tokens_warm"] > 0.9 * warm["prompt_tokens"]  # mlx-lm's prompt cache served the repeat
    assert by_name["agent_replay"].metrics["cache_hit_pct"] > 30
    assert by_name["speculative"].status == "skipped"


def test_cli_compare_json_and_submit(mlx_lm_server: str, receiver, bench_dir) -> None:
    """`kapitsa bench --no-local --compare URL --json --submit` prints JSON, asks, posts, keeps the file."""
    args = [
        "bench",
        "--no-local",
        "--quick",
        "--compare",
        mlx_lm_server,
        "--json",
        "--submit",
        "--results-url",
        receiver.url,
    ]
    result = CliRunner().invoke(app, args, input="y\n", catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout[: result.stdout.rindex("}") + 1])
    assert report["engines"][0]["url"] == f"{mlx_lm_server}/v1"
    assert "Post these results to" in result.stderr and "submitted to" in result.stderr
    assert receiver.received == [report]
    assert [p.name for p in bench_dir.iterdir()][0].startswith("bench-")


async def test_declined_submit_shows_the_json_and_posts_nothing(receiver, bench_dir, capsys) -> None:
    """Check the confirm step: the JSON is printed before the question, and "no" posts nothing."""
    report = BenchReport(machine={}, config={}, engines=[await run_bench(EngineTarget(FakeEngine()), TINY)])
    path = save_report(report)
    questions: list[str] = []
    options = BenchOptions(submit=True, results_url=receiver.url)
    confirm_and_submit(report, path, options, confirm=lambda q: questions.append(q) or False)
    out = capsys.readouterr()
    assert json.loads(out.out) == report.to_dict() and questions == [f"Post these results to {receiver.url}?"]
    assert "not submitted" in out.err and receiver.received == [] and path.exists()


def test_cli_no_local_needs_a_url() -> None:
    result = CliRunner().invoke(app, ["bench", "--no-local"])
    assert result.exit_code != 0 and "--compare" in result.output


@pytest.mark.slow
def test_cli_kapitsa_and_mlx_lm_side_by_side(mlx_lm_server: str, tiny_qwen_dir) -> None:
    """The same checkpoint in kapitsa's engine and in mlx_lm.server, one column each."""
    args = ["bench", "--model", str(tiny_qwen_dir), "--quick", "--compare", mlx_lm_server]
    result = CliRunner().invoke(app, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    header = result.stdout.splitlines()[2]
    assert "kapitsa (tiny-qwen3_5)" in header and f"{mlx_lm_server}/v1" in header
    hit_row = next(line for line in result.stdout.splitlines() if line.startswith("agent replay cache hit %"))
    assert "n/a" not in hit_row and "error" not in hit_row


def test_cli_bench_compare_a_second_kapitsa_serve_and_mlx_lm(kapitsa_server: str, mlx_lm_server: str) -> None:
    """`kapitsa bench compare URL URL --no-local`: one column per server, each workload's figures as it lands."""
    args = ["bench", "compare", kapitsa_server, mlx_lm_server, "--no-local", "--quick"]
    result = CliRunner().invoke(app, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert f"{kapitsa_server}/v1" in lines[2] and f"{mlx_lm_server}/v1" in lines[2]
    decode_row = next(line for line in lines if line.startswith("decode tok/s (short prompt)"))
    assert len(re.findall(r"\b\d+\.\d\b", decode_row)) == 2, decode_row  # a figure per server, 1 decimal
    assert "error" not in result.stdout
    assert re.search(rf"\[{re.escape(kapitsa_server)}/v1\] decode_short: decode_tok_s=\d", result.stderr)
    assert "overall 14/14" in result.stderr and re.search(r"ETA \d+s", result.stderr)


def test_cli_bench_words_other_than_compare_are_refused() -> None:
    for args in (["bench", "frobnicate"], ["bench", "compare"]):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2 and "bench compare URL" in result.output, result.output


def test_cli_bench_runs_only_the_chosen_workloads(kapitsa_server: str) -> None:
    args = ["bench", "compare", kapitsa_server, "--no-local", "--quick", "--json"]
    args += ["--workload", "concurrent_4", "--workload", "decode_short"]
    result = CliRunner().invoke(app, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["config"]["workloads"] == ["decode_short", "concurrent_4"]
    assert [w["name"] for w in report["engines"][0]["workloads"]] == ["decode_short", "concurrent_4"]
    assert all(w["status"] == "ok" for w in report["engines"][0]["workloads"])


def test_cli_bench_refuses_an_unknown_workload_before_loading_anything() -> None:
    result = CliRunner().invoke(app, ["bench", "--workload", "decode_fast"])
    assert result.exit_code == 2 and "unknown workload decode_fast" in result.output, result.output


def test_cli_bench_workload_and_tune_speculation_do_not_mix() -> None:
    result = CliRunner().invoke(app, ["bench", "--tune-speculation", "--workload", "decode_short"])
    assert result.exit_code == 2 and "--tune-speculation times its own workload" in result.output, (
        result.output
    )
