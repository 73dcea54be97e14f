"""`--compare` against a real `mlx_lm.server` serving a tiny checkpoint, and the CLI around it."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kapitsa.bench.command import QUICK_CONFIG
from kapitsa.bench.runner import WORKLOAD_NAMES, run_bench
from kapitsa.bench.targets import HttpTarget, normalize_base_url
from kapitsa.cli import app
from kapitsa.errors import InvalidRequest


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
    await target.resolve_model()
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


def test_cli_submit_declined_posts_nothing(mlx_lm_server: str, receiver) -> None:
    args = [
        "bench",
        "--no-local",
        "--quick",
        "--compare",
        mlx_lm_server,
        "--submit",
        "--results-url",
        receiver.url,
    ]
    result = CliRunner().invoke(app, args, input="n\n", catch_exceptions=False)
    assert result.exit_code == 0
    assert "decode tok/s (short prompt)" in result.stdout
    assert '"schema": "kapitsa-bench"' in result.stdout  # the JSON was shown before asking
    assert "not submitted" in result.stderr and receiver.received == []


def test_cli_no_local_needs_a_url() -> None:
    result = CliRunner().invoke(app, ["bench", "--no-local"])
    assert result.exit_code != 0 and "--compare" in result.output
