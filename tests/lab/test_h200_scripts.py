"""The H200 benchmark scripts run end to end on CPU with tiny widths (`--tiny`), so a broken
script is found here rather than after spending device time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(args: list[str], tmp_path: Path) -> list[dict]:
    out = tmp_path / "out.json"
    subprocess.run(
        [sys.executable, *args, "--tiny", "--json", str(out)],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=600,
    )
    return json.loads(out.read_text())


def test_decode_vs_mlxlm_times_both_engines_interleaved(tmp_path: Path) -> None:
    rows = _run(
        ["lab/decode_vs_mlxlm.py", "--shapes", "4b", "--tokens", "4", "--prompts", "8", "--rounds", "2"],
        tmp_path,
    )
    assert [(r["engine"], r["round"]) for r in rows] == [
        ("mlx-lm", 0),
        ("kapitsa", 0),
        ("mlx-lm", 1),
        ("kapitsa", 1),
    ]
    assert all(r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0 for r in rows)


def test_decode_vs_mlxlm_fused_ab_and_prefill_only(tmp_path: Path) -> None:
    """--fused-ab adds a kapitsa-fused run per round (the flag is back off afterwards);
    --prefill-prompts adds one prefill-only row per engine."""
    rows = _run(
        [
            "lab/decode_vs_mlxlm.py", "--shapes", "4b", "--tokens", "4", "--prompts", "8", "--rounds", "1",
            "--fused-ab", "norm,residual", "--prefill-prompts", "16",
        ],
        tmp_path,
    )  # fmt: skip
    assert [r["engine"] for r in rows if not r.get("prefill_only")] == ["mlx-lm", "kapitsa", "kapitsa-fused"]
    assert rows[2]["fused_parts"] == "norm,residual"
    prefill = [r for r in rows if r.get("prefill_only")]
    assert [(r["engine"], r["prompt"]) for r in prefill] == [("mlx-lm", 16), ("kapitsa", 16)]
    assert all(r["prefill_tok_s"] > 0 for r in prefill)


def test_decode_vs_mlxlm_kernel_and_fold_variants(tmp_path: Path) -> None:
    """--kernels-ab times the same model under other kernel families; --fold-ab a copy (MoE
    shapes) prepared with shared-expert folding on."""
    rows = _run(
        [
            "lab/decode_vs_mlxlm.py", "--shapes", "35b-a3b", "--tokens", "4", "--prompts", "8", "--rounds", "1",
            "--kernels-ab", "gdn,qmv", "--fold-ab",
        ],
        tmp_path,
    )  # fmt: skip
    engines = [r["engine"] for r in rows]
    assert engines == ["mlx-lm", "kapitsa", "kapitsa-kernels", "kapitsa-folded"]
    assert rows[2]["kernels"] == "gdn,qmv" and rows[3]["folded"] is True
    assert all(r["decode_tok_s"] > 0 for r in rows)


def test_decode_profile_splits_a_step(tmp_path: Path) -> None:
    rows = _run(
        ["lab/decode_profile.py", "--shapes", "nemotron-30b-a3b", "--steps", "2", "--prompt", "4"],
        tmp_path,
    )
    variants = [r["variant"] for r in rows]
    assert variants[0] == "mlx-lm" and "kapitsa fused+compiled" in variants
    assert "kapitsa fused+compiled+routed" in variants
    for r in rows:
        assert r["sync_step_ms"] >= r["build_ms"] > 0


def test_edit_speculation_writes_the_true_answer_with_long_accepted_drafts(tmp_path: Path) -> None:
    """spec_shapes.py: the scripted target writes the edit's true answer under plain decoding and
    under n-gram speculation alike; the answer copies the prompt, so drafts are mostly accepted."""
    rows = _run(
        [
            "lab/decode_vs_mlxlm.py", "--shapes", "nemotron-30b-a3b", "--tokens", "4", "--prompts", "8",
            "--rounds", "1", "--verify-shapes", "nemotron-30b-a3b", "--verify-sizes", "1", "3",
            "--spec-shapes", "nemotron-30b-a3b", "--spec-tokens", "64",
        ],
        tmp_path,
    )  # fmt: skip
    spec = {r["engine"]: r for r in rows if r.get("tokens") == 64}
    assert set(spec) == {"kapitsa-plain", "kapitsa-spec", "mlx-lm"}
    assert spec["kapitsa-plain"]["same_as_plain"] and spec["kapitsa-spec"]["same_as_plain"]
    assert spec["kapitsa-spec"]["tokens_per_step"] > 2.0 and spec["kapitsa-spec"]["acceptance"] > 0.5
    verify = next(r for r in rows if "verify_ms_T3" in r)
    assert verify["verify_ms_T3"] > 0 and verify["rollback_ms_T3"] > 0


def test_edit_speculation_under_the_fused_ab_parts(tmp_path: Path) -> None:
    """--fused-ab adds speculation under those parts to each spec round (kapitsa-spec-fused); it
    writes the same answer, and the summary reports it beside the default."""
    args = [
        "lab/decode_vs_mlxlm.py", "--shapes", "4b", "--tokens", "4", "--prompts", "8", "--rounds", "1",
        "--fused-ab", "norm,residual,glu", "--spec-shapes", "4b", "--spec-tokens", "32",
    ]  # fmt: skip
    done = subprocess.run(
        [sys.executable, *args, "--tiny", "--json", str(tmp_path / "out.json")],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    spec = {r["engine"]: r for r in json.loads((tmp_path / "out.json").read_text()) if r.get("tokens") == 32}
    assert set(spec) == {"kapitsa-plain", "kapitsa-spec", "kapitsa-spec-fused", "mlx-lm"}
    assert spec["kapitsa-spec-fused"]["fused_parts"] == "norm,residual,glu"
    assert spec["kapitsa-spec-fused"]["same_as_plain"]
    summary = next(json.loads(line) for line in done.stdout.splitlines() if '"4b edit speculation"' in line)
    assert summary["kapitsa_spec_fused"] > 0 and summary["spec_fused_vs_mlxlm"] > 0


def test_pick_knobs_keeps_a_setting_only_when_it_beats_the_default() -> None:
    sys.path.insert(0, str(ROOT / "lab"))
    from pick_knobs import pick

    def line(knob: str, plain: float, fused: float | None = None) -> str:
        return json.dumps(dict(knob=knob, summary="4b", kapitsa_decode=plain, kapitsa_fused_decode=fused))

    noise = ["mlx 0.32.4 on gpu", json.dumps(dict(knob="default", shape="4b", decode_tok_s=1.0))]
    assert pick([*noise, line("default", 200.0), line("MLX_USE_CUDA_GRAPHS=0", 260.0, 250.0)]) == (
        "MLX_USE_CUDA_GRAPHS=0"
    )
    assert pick([line("default", 200.0, 240.0), line("MLX_USE_CUDA_GRAPHS=0", 230.0)]) is None
    assert pick([line("default", 200.0), line("MLX_MAX_OPS_PER_BUFFER=1000", 202.0)]) is None
    assert pick(noise) is None
    kernels = json.dumps(
        dict(knob="default", summary="4b", kapitsa_decode=100.0, kapitsa_kernels_decode=300.0)
    )
    assert pick([kernels, line("MLX_USE_CUDA_GRAPHS=0", 200.0)]) is None  # the default's variant was best
    assert pick([line("MLX_USE_CUDA_GRAPHS=0", 150.0)]) is None  # the default's run timed out


def _json_lines(args: list[str], env: dict[str, str] | None = None) -> list[dict]:
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **env} if env else None,
    )
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_host_costs_counts_both_engines_primitives() -> None:
    rows = _json_lines(["lab/host_costs.py", "--tiny", "--shapes", "4b", "--skip", "micro", "--steps", "4"])
    steps = {r["engine"]: r for r in rows if r["kind"] == "step"}
    assert set(steps) == {"kapitsa", "mlx-lm"}
    assert all(r["primitives"] > 0 and r["pipelined_step_ms"] > 0 for r in steps.values())
    assert steps["kapitsa"]["primitives"] < steps["mlx-lm"]["primitives"]


def test_graph_census_sees_the_opt_in_kernels_remove_primitives() -> None:
    """The census builds the CUDA code paths on the CPU: the fused router and the decode
    attention, switched on, each take primitives out of a tiny Qwen MoE step."""

    def count(families: str) -> int:
        rows = _json_lines(
            ["lab/graph_census.py", "--tiny", "--shapes", "35b-a3b", "--env", f"KAPITSA_KERNELS={families}"]
        )
        return rows[0]["primitives"]

    base = count("gdn,moe,qmv,mamba")
    assert count("gdn,moe,qmv,mamba,route") < base
    assert count("gdn,moe,qmv,mamba,attn") < base


def test_prefill_parts_times_each_layer_kind_and_its_variants() -> None:
    rows = _json_lines(
        ["lab/prefill_parts.py", "--tiny", "--prompt", "16", "--ssd-chunks", "8", "--moe-dequant-ab"]
    )
    base = {r["layer"]: r for r in rows if "mlx-lm_ms_per_layer" in r}
    assert set(base) == {"mamba", "moe", "attention"}
    assert all(r["kapitsa_total_s"] > 0 and r["mlx-lm_total_s"] > 0 for r in base.values())
    variants = [r for r in rows if "mlx-lm_ms_per_layer" not in r]
    assert [(r["layer"], r.get("ssd_chunk"), r.get("moe_dequant")) for r in variants] == [
        ("mamba", 8, None),
        ("moe", None, False),
    ]


def test_decode_kernels_runs_steps_and_summarizes_a_report(tmp_path: Path) -> None:
    import sqlite3

    rows = _json_lines(["lab/decode_kernels.py", "--tiny", "--shape", "4b", "--steps", "2", "--prompt", "4"])
    assert rows == [dict(shape="4b", steps=2, profiler_range=False)]
    report = tmp_path / "steps.sqlite"  # the two tables of nsys's SQLite export the summary reads
    con = sqlite3.connect(report)
    con.execute("CREATE TABLE StringIds(id INTEGER, value TEXT)")
    con.execute("CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL(start INTEGER, end INTEGER, demangledName INTEGER)")
    con.executemany(
        "INSERT INTO StringIds VALUES (?, ?)",
        [
            (1, "custom_kernel_kapitsa_matvec_one_row_bfloat16_t_1_5120_6144_64_4_4_4_2_f_f_0_0_f"),
            (2, "void qmv_kernel<8>(int)"),
        ],
    )
    con.executemany(
        "INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?, ?, ?)", [(0, 3000, 1), (5, 1005, 1), (0, 1000, 2)]
    )
    con.commit()
    table = _json_lines(["lab/decode_kernels.py", "--summarize", str(report), "--steps", "2"])
    assert table[0] == dict(
        kernel="custom_kernel_kapitsa_matvec_one_row", ms_per_step=0.002, share=0.8, launches_per_step=1.0
    )
    assert table[-1] == dict(kind="step_total", gpu_ms_per_step=0.003, launches_per_step=1.5)


def test_a_failing_variant_is_reported_not_fatal() -> None:
    """A variant whose kernel fails gives an error row; the defaults' rounds and the other
    variants of the same process go on. The timer gets the variant's kernel options."""
    import mlx.nn as nn

    from kapitsa.engine.options import KernelOptions
    from lab.variants import Variant, timed_with

    variant = Variant(KernelOptions(moe_dequant=False), {"variant": "x"})

    def failing_timer(model, prompt, tokens, warmup=None, *, kernels):
        raise RuntimeError("kernel compile failed")

    def timer(model, prompt, tokens, warmup=None, *, kernels):
        return {"decode_tok_s": 1.0, "moe_dequant": kernels.moe_dequant}

    model = nn.Linear(4, 4)
    row = timed_with(variant, failing_timer)(model, [1, 2], 4)
    assert row == {"error": "RuntimeError: kernel compile failed"}
    ok = timed_with(variant, timer)(model, [1], 4)
    assert ok == {"decode_tok_s": 1.0, "moe_dequant": False, "variant": "x"}


def test_batch_sweep_times_both_engines_per_stream_count() -> None:
    rows = _json_lines(
        [
            "lab/batch_sweep.py",
            "--tiny",
            "--shapes",
            "4b",
            "--streams",
            "1,2",
            "--tokens",
            "4",
            "--prompt",
            "8",
        ]
    )
    assert [(r["engine"], r["streams"]) for r in rows] == [
        ("kapitsa", 1),
        ("kapitsa", 2),
        ("mlx-lm", 1),
        ("mlx-lm", 2),
    ]
    assert all(r["aggregate_tok_s"] > 0 and r["wall_s"] > 0 for r in rows)
    # kapitsa's first burst of a size is timed against a second one; mlx-lm's warms up on short prompts
    assert all(("first_burst_extra_s" in r) == (r["engine"] == "kapitsa") for r in rows)
    # nothing ran out of memory: the full batch was allowed, and no row of either burst went back
    kapitsa = [r for r in rows if r["engine"] == "kapitsa"]
    assert all(
        r["limit"] >= r["streams"] and r["sent_back"] == r["first_burst_sent_back"] == 0 for r in kapitsa
    )


def test_decode_gaps_times_every_case_and_sums_them_up() -> None:
    rows = _json_lines(
        [
            "lab/decode_gaps.py",
            "--tiny",
            "--shapes",
            "4b",
            "--tokens",
            "3",
            "--long-prompt",
            "40",
            "--rounds",
            "1",
        ]
    )
    cases = ["512", "512x12", "40", "40x12", "512 room16", "512 room16 warmed"]
    assert [r["case"] for r in rows[:-1]] == cases
    assert all(r["decode_tok_s"] > 0 for r in rows[:-1])
    assert rows[-1]["summary"] == "4b" and all(rows[-1][case] > 0 for case in cases)


def test_repeat_decode_reports_each_variant_against_its_first_run() -> None:
    """Greedy decoding on the CPU repeats itself under every setting; the summary compares each
    variant's tokens with the default's."""
    done = subprocess.run(
        [
            sys.executable, "lab/repeat_decode.py", "--tiny", "--shape", "nemotron-30b-a3b", "--tokens", "6",
            "--prompt", "12", "--repeats", "2", "--variants", "default", "KAPITSA_COMPILE_DECODE=0+KAPITSA_KERNELS=none",
        ],
        cwd=ROOT, check=True, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    variants = [r for r in rows if "variant" in r]
    assert [r["variant"] for r in variants] == ["default", "KAPITSA_COMPILE_DECODE=0+KAPITSA_KERNELS=none"]
    assert all(r["identical"] and r["first_divergence"] == [None] for r in variants)
    assert rows[-1]["same_as_default"]["default"] is None


def test_first_divergence_finds_the_first_differing_position() -> None:
    sys.path.insert(0, str(ROOT))
    from lab.repeat_decode import first_divergence

    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2


def test_startup_compile_reports_each_phase_and_the_cache_folder(tmp_path) -> None:
    rows = _json_lines(
        [
            "lab/startup_compile.py",
            "--tiny",
            "--shapes",
            "4b,nemotron-30b-a3b",
            "--prompt",
            "24",
            "--tokens",
            "3",
        ],
        env={"MLX_PTX_CACHE_DIR": str(tmp_path)},
    )
    assert [r["shape"] for r in rows] == ["4b", "nemotron-30b-a3b"]
    assert all(r["first_request_s"] >= r["first_ttft_s"] > 0 and r["build_s"] > 0 for r in rows)
    assert all(r["disk_cache"] == "on" and r["added"] == 0 for r in rows)  # no CUDA here: nothing compiled


def test_decode_vs_mlxlm_long_rounds_apply_from_4096_tokens(tmp_path: Path) -> None:
    rows = _run(
        [
            "lab/decode_vs_mlxlm.py", "--shapes", "4b", "--tokens", "2", "--prompts", "8", "4096",
            "--rounds", "2", "--long-rounds", "1",
        ],
        tmp_path,
    )  # fmt: skip
    assert [(r["prompt"], r["round"]) for r in rows if r["engine"] == "kapitsa"] == [
        (8, 0),
        (8, 1),
        (4096, 0),
    ]


def test_server_bench_runs_both_servers_on_the_chosen_workloads(tmp_path: Path) -> None:
    """serve, serve without speculation and mlx_lm.server on a tiny shape's folder, two workloads."""
    done = subprocess.run(
        [
            sys.executable, "lab/server_bench.py", "--shape", "4b", "--tiny", "--tokens", "4", "--streams", "2",
            "--workloads", "concurrent_4", "decode_short", "--no-local", "--plain-serve", "--work", str(tmp_path),
        ],
        cwd=ROOT, check=True, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    report, totals = (json.loads(line) for line in done.stdout.splitlines()[-2:])
    names = [e["name"] for e in report["engines"]]
    assert names == ["kapitsa serve", "kapitsa serve --speculative none", "mlx_lm.server"]
    assert all(
        [w["name"] for w in e["workloads"]] == ["decode_short", "concurrent_4"] for e in report["engines"]
    )
    assert all(row["decode_tok_s"] > 0 and row["concurrent_tok_s"] > 0 for row in totals["summary"].values())
    assert totals["kapitsa_serve_vs_mlx_lm_server"] > 0 and "server_overhead" not in totals
    assert totals["kapitsa_serve_plain_ready_s"] > 0 and (tmp_path / "kapitsa-plain.log").exists()


def test_nvrtc_parallel_compiles_distinct_programs_each_way() -> None:
    """Each way compiles programs no other way compiled (a token count each), so no way is timed
    over another's work; with an NVRTC and CUDA headers at hand (KAPITSA_TEST_NVRTC, CUDA_HOME)
    the script runs all three ways."""
    sys.path.insert(0, str(ROOT))
    try:
        from lab.nvrtc_parallel import source
    finally:
        sys.path.remove(str(ROOT))
    names = {source(tokens)[0] for tokens in range(1, 7)}
    texts = {source(tokens)[1] for tokens in range(1, 7)}
    assert len(names) == len(texts) == 6
    library = os.environ.get("KAPITSA_TEST_NVRTC")
    home = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "include"
    if not library or not (home / "cuda_bf16.h").exists() or not (home / "cccl").exists():
        return
    args = ["lab/nvrtc_parallel.py", "--library", library, "--count", "2", "--workers", "2", "--arch", "9.0"]
    row = _json_lines(args)[-1]
    assert row["count"] == 2 and len(row["threads_with_child_processes_each_s"]) == 2
    assert all(
        row[f"{way}_s"] > 0 for way in ("one_after_another", "threads", "threads_with_child_processes")
    )


def test_server_overhead_times_both_in_process_engines_and_the_server() -> None:
    rows = _json_lines(
        [
            "lab/server_overhead.py",
            "--shape",
            "4b",
            "--tiny",
            "--tokens",
            "6",
            "--rounds",
            "1",
            "--ignore-eos",
        ]
    )
    assert [r["in_process"] for r in rows[:2]] == ["plain", "warm"] and rows[2]["served"]
    sides = rows[3:6]
    assert [r["side"] for r in sides] == ["in process, plain", "in process, warm", "served"]
    assert all(r["tokens"] == 6 and len(r["tok_s"]) == 1 and r["median_tok_s"] > 0 for r in sides)
    assert "client_cpu_ms_per_token" in sides[2] and sides[0]["thread_cpu_ms_per_token"]
    assert sorted(rows[-1]) == ["overhead_vs_in process, plain", "overhead_vs_in process, warm"]


def test_batch_sweep_reads_the_devices_memory_in_use_from_nvidia_smi(tmp_path, monkeypatch) -> None:
    """The gap between MLX's count and the device's is what an out-of-memory step ran into."""
    sys.path.insert(0, str(ROOT))
    try:
        from lab import batch_sweep
    finally:
        sys.path.remove(str(ROOT))
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 40960\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert batch_sweep._memory_gb()["device_used_gb"] == 40.0
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    assert "device_used_gb" not in batch_sweep._memory_gb()


def test_moe_route_cold_times_each_case_per_round() -> None:
    """Every case of lab/moe_route_cold.py, in order each round, with the warm-up it names: under
    the route's token-expert pairs only in no-route-warm."""
    done = subprocess.run(
        [sys.executable, "lab/moe_route_cold.py", "--tiny", "--shapes", "nemotron-30b-a3b", "--prompt", "300",
         "--rounds", "2"],
        cwd=ROOT, check=True, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    head, cases = rows[0], rows[1:]
    assert head["prompt_pairs"] == 300 * head["top_k"]
    assert [(r["round"], r["case"]) for r in cases] == [(n, c) for n in (0, 1) for c in
                                                        ("route-warm", "no-route-warm", "cleared", "again")]  # fmt: skip
    under = [r["warmup_tokens"] for r in cases if r["case"] == "no-route-warm"]
    assert all(n * head["top_k"] < head["route_min_pairs"] for n in under)
    assert all(r["warmup_tokens"] == 300 for r in cases if r["case"] != "no-route-warm")
    assert all(r["ttft_s"] > 0 and r["prefill_tok_s"] > 0 for r in cases)
