"""lab/results_table.py: the server bench's summary line becomes a row of the through-the-server table."""

import json

from lab.results_table import PLAIN_SERVE, engine_decode, server_rows, server_table


def _summary(decode: dict[str, float]) -> dict:
    rows = {
        n: {"decode_tok_s": v, "ttft_s": 0.5, "concurrent_tok_s": 2 * v, "replay_mean_ttft_s": 0.1}
        for n, v in decode.items()
    }
    return {
        "summary": rows,
        "server_overhead": 0.02,
        "kapitsa_serve_vs_mlx_lm_server": 3.1,
        "kapitsa_serve_ready_s": 9.5,
    }


def test_server_log_gives_its_shape_and_row(tmp_path) -> None:
    log = tmp_path / "server-whatever.log"
    report = {"schema": "kapitsa-bench", "engines": [{"name": "x", "model": "shape-27b", "workloads": []}]}
    line = _summary({"kapitsa engine": 100.0, "kapitsa serve": 98.0, "mlx_lm.server": 31.6})
    log.write_text("progress line\n" + json.dumps(report) + "\n" + json.dumps(line) + "\n")
    shape, row = server_rows(log)
    assert shape == "27b"
    text = server_table([(shape, row)])
    assert "| 27b | 100.0 / 98.0 / 31.6 (3.10x) |" in text
    assert "2.0%" in text and "9.5 / -" in text


def test_table_log_is_not_a_server_log(tmp_path) -> None:
    log = tmp_path / "table-4b.log"
    log.write_text(json.dumps({"summary": "4b", "prompt": 512, "kapitsa_decode": 1.0}) + "\n")
    assert server_rows(log) is None


def test_missing_engine_reads_as_a_dash(tmp_path) -> None:
    log = tmp_path / "server-4b.log"
    log.write_text(json.dumps(_summary({"kapitsa serve": 50.0})) + "\n")
    shape, row = server_rows(log)
    assert shape == "4b"
    assert "- / 50.0 / -" in server_table([(shape, row)])


def test_without_the_engine_in_process_the_overhead_comes_from_the_table(tmp_path) -> None:
    """`--no-local`: serve's decode against the table's batch-1 decode of the shape; `--plain-serve`
    gets its own column."""
    line = _summary({"kapitsa serve": 90.0, PLAIN_SERVE: 95.0, "mlx_lm.server": 30.0})
    del line["server_overhead"]
    line["streams_serve_vs_mlx_lm_server"] = 3.0
    table_row = {"summary": "27b", "prompt": 512, "kapitsa_decode": 100.0}
    assert engine_decode([table_row, {"summary": "27b", "prompt": 8192, "kapitsa_decode": 80.0}]) == {
        "27b": 100.0
    }
    text = server_table([("27b", line)], {"27b": 100.0})
    assert "| 27b | - / 90.0 / 30.0 (3.10x) |" in text
    assert "| - / 180.0 / 60.0 (3.00x) |" in text
    assert "| 95.0 / 190.0 | 10.0% (vs the table) |" in text


def test_a_process_cut_before_its_summary_lines_gets_its_row_from_the_timed_rounds() -> None:
    """A stream sweep that ran out of memory ended the 27B's process before it wrote summaries."""
    from lab.results_table import table

    def timed(engine: str, decode: float, prefill: float) -> dict:
        return dict(shape="27b", engine=engine, prompt=512, decode_tok_s=decode, prefill_tok_s=prefill)

    records = [
        timed("mlx-lm", 50.0, 270.0),
        timed("kapitsa", 95.0, 3400.0),
        timed("mlx-lm", 54.0, 260.0),
        timed("kapitsa", 97.0, 3600.0),
        dict(shape="27b", engine="kapitsa", streams=1, aggregate_tok_s=94.1, first_burst_extra_s=0.0),
    ]
    text = table(records)
    assert "| 27b | 96.0 (52.0, 1.85x) | 3500 (265) | 94.1 (-) |" in text


def test_a_burst_with_rows_sent_back_says_so() -> None:
    from lab.results_table import table

    def burst(streams: int, tok_s: float, sent_back: int) -> dict:
        return dict(
            shape="27b", engine="kapitsa", streams=streams, aggregate_tok_s=tok_s,
            first_burst_extra_s=0.0, sent_back=sent_back,
        )  # fmt: skip

    rows = [burst(16, 500.0, 16), burst(8, 400.0, 0)]
    text = table(rows)
    assert "| 400.0 (-) | 500.0 (-), 16 rows sent back |" in text


def test_a_burst_run_under_a_halved_limit_is_no_figure_of_its_streams() -> None:
    """The first 16-stream burst ran out of memory and sent its rows back, halving the limit; the
    timed burst then ran 8 at a time, in two waves: its rate is not a 16-stream rate."""
    from lab.results_table import table

    rows = [
        dict(shape="27b", engine="kapitsa", streams=8, aggregate_tok_s=389.4, sent_back=0, limit=16),
        dict(
            shape="27b", engine="kapitsa", streams=16, aggregate_tok_s=767.9, sent_back=0, limit=8,
            first_burst_sent_back=16, first_burst_extra_s=4.3,
        ),
        dict(shape="27b", engine="mlx-lm", streams=16, aggregate_tok_s=80.3),
    ]  # fmt: skip
    text = table(rows)
    assert "| 389.4 (-) |" in text and "767.9" not in text
    assert "not measured: ran at most 8 at once (80.3), its first burst sent 16 rows back |" in text


CUT_LOG = """checkpoint /tmp/x/shape-27b written in 20.1 s
[kapitsa] 1/2 decode_short · ETA …
[kapitsa] decode_short: decode_tok_s=150.0 ttft_s=0.42 prompt_tokens=199 completion_tokens=128
[kapitsa] concurrent_4: aggregate_tok_s=215.0 streams=8 completion_tokens=1024 wall_s=4.76
kapitsa serve ready after 10.0 s
kapitsa serve warmed its batch sizes in 3.7 s
[http://127.0.0.1:5/v1] decode_short: decode_tok_s=240.0 ttft_s=0.44 prompt_tokens=197 completion_tokens=128
[http://127.0.0.1:5/v1] agent_replay: cache_hit_pct=72.3 turns=4 mean_ttft_s=0.67
[http://127.0.0.1:5/v1] speculative: acceptance_pct=n/a
-m mlx_lm.server --model ready after 12.7 s
[http://127.0.0.1:6/v1] decode_short: decode_tok_s=60.0 ttft_s=1.68 prompt_tokens=191 completion_tokens=128
[http://127.0.0.1:6/v1] 2/2 ttft_cold_warm · ETA 23s
"""


def test_a_bench_cut_before_its_summary_gets_its_row_from_the_workload_lines(tmp_path) -> None:
    log = tmp_path / "server-bench-27b-h100.log"  # the shape comes from the checkpoint line
    log.write_text(CUT_LOG)
    shape, row = server_rows(log)
    assert shape == "27b" and row["cut"] is True
    engine, serve, mlx = (row["summary"][n] for n in ("kapitsa engine", "kapitsa serve", "mlx_lm.server"))
    assert (engine["decode_tok_s"], serve["decode_tok_s"], mlx["decode_tok_s"]) == (150.0, 240.0, 60.0)
    assert engine["concurrent_tok_s"] == 215.0 and serve["concurrent_tok_s"] is None
    assert serve["replay_mean_ttft_s"] == 0.67 and mlx["ttft_s"] == 1.68
    assert row["kapitsa_serve_vs_mlx_lm_server"] == 4.0 and row["server_overhead"] == -0.6
    assert "streams_serve_vs_mlx_lm_server" not in row  # mlx_lm.server's streams never ran
    assert (row["kapitsa_serve_ready_s"], row["kapitsa_serve_warmup_s"], row["mlx_lm_server_ready_s"]) == (
        10.0,
        3.7,
        12.7,
    )
    assert "27b (cut by its timeout) | 150.0 / 240.0 / 60.0 (4.00x)" in server_table([(shape, row)])


def test_a_log_with_only_the_engine_in_process_has_no_server_row(tmp_path) -> None:
    log = tmp_path / "server-4b.log"
    log.write_text(CUT_LOG.split("kapitsa serve ready")[0])
    assert server_rows(log) is None
