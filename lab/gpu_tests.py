"""Run the whole `-m gpu` test set at once, sharded over parallel pytest processes.

Why: on a fresh H200 the set (~540 cases) takes ~18 minutes in one process, nearly all of it
NVRTC compiling each case's kernel on one CPU core, so no single 10-minute device call ever ran
it. Shards compile in parallel on the machine's cores and share the one GPU. Each shard keeps its
own MLX PTX cache (MLX_PTX_CACHE_DIR; MLX writes cache files in place, so two processes compiling
the same kernel could read each other's half-written file), seeded from /tmp/mlx's when present.

Each shard streams one JSON line per test phase (the `gpu_report` plugin below), so a shard cut
by the deadline still reports what it ran; what it did not reach is named "not run".

    python lab/gpu_tests.py --shards 8 --budget 540 [--out DIR] [pytest paths or node ids]

Prints one JSON line per failure, then a summary line; exits 1 on any failure, any case not run,
or when nothing ran on a GPU (every case skipped: not a CUDA machine).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTEST = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts="]
SEED_PTX = Path("/tmp/mlx")


def collect(paths: list[str], marker: str, cwd: Path = ROOT) -> list[str]:
    """Node ids of the `marker` tests under `paths`, in collection order (relative to `cwd`, the
    rootdir the shards run in)."""
    done = subprocess.run(
        [*PYTEST, "--collect-only", "-q", "-m", marker, *paths],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=False,
    )
    ids = [line for line in done.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if not ids:
        raise SystemExit(
            f"no {marker!r} tests collected under {paths}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )
    return ids


def shard(ids: list[str], shards: int) -> list[list[str]]:
    """Round-robin: a test function's cases (often the slowest, one compile each) spread over
    every shard instead of landing on one."""
    return [part for part in (ids[i::shards] for i in range(shards)) if part]


def merge(lines: list[dict], expected: list[str]) -> dict:
    """One outcome per node id from the plugin's phase lines: a failure in any phase counts,
    then a skip, then the call's pass; ids with no line are "not run"."""
    outcome: dict[str, dict] = {}
    rank = {"passed": 0, "skipped": 1, "failed": 2}
    for line in lines:
        kept = outcome.get(line["nodeid"])
        if line["when"] != "call" and line["outcome"] == "passed":
            continue  # setup/teardown passing says nothing about the test
        if kept is None or rank[line["outcome"]] >= rank[kept["outcome"]]:
            outcome[line["nodeid"]] = line
    counts = {"passed": 0, "failed": 0, "skipped": 0, "not_run": 0}
    failures, skip_reasons, not_run = [], {}, []
    for nodeid in expected:
        line = outcome.get(nodeid)
        if line is None:
            counts["not_run"] += 1
            not_run.append(nodeid)
            continue
        counts[line["outcome"]] += 1
        if line["outcome"] == "failed":
            failures.append({"nodeid": nodeid, "when": line["when"], "message": line["message"]})
        elif line["outcome"] == "skipped":
            skip_reasons[line["message"]] = skip_reasons.get(line["message"], 0) + 1
    return dict(counts=counts, failures=failures, skip_reasons=skip_reasons, not_run=not_run)


def _shard_env(index: int, out: Path) -> dict:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "lab"), os.environ.get("PYTHONPATH")])),
    )
    cache = Path(f"/tmp/mlx-ptx-shard{index}")
    if not cache.exists() and SEED_PTX.is_dir():
        seeded = next(SEED_PTX.glob("*/ptx"), None)
        if seeded is not None:
            shutil.copytree(seeded, cache)
    env["MLX_PTX_CACHE_DIR"] = str(cache)
    env["GPU_REPORT_FILE"] = str(out / f"shard{index}.jsonl")
    return env


def run_shards(parts: list[list[str]], budget_s: float, out: Path, cwd: Path = ROOT) -> list[dict]:
    """Every shard at once; each killed at the deadline. Returns every phase line written."""
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + budget_s
    procs = []
    for i, ids in enumerate(parts):
        log = open(out / f"shard{i}.log", "w")  # noqa: SIM115 - closed below, after the process
        cmd = [*PYTEST, "-p", "gpu_tests", "-q", "-rfE", "--tb=short", *ids]
        procs.append(
            (
                subprocess.Popen(cmd, cwd=cwd, env=_shard_env(i, out), stdout=log, stderr=subprocess.STDOUT),
                log,
            )
        )
    for proc, log in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    lines = []
    for i in range(len(parts)):
        report = out / f"shard{i}.jsonl"
        if report.exists():
            lines += [json.loads(text) for text in report.read_text().splitlines() if text.strip()]
    return lines


# --- the pytest plugin each shard loads (-p gpu_tests): one JSON line per test phase, flushed as it
# happens, so a shard killed at the deadline still leaves what it ran.


def pytest_runtest_logreport(report) -> None:
    path = os.environ.get("GPU_REPORT_FILE")
    if not path or (report.when != "call" and report.outcome == "passed"):
        return
    message = ""
    if report.skipped and isinstance(report.longrepr, tuple):
        message = str(report.longrepr[2])  # (path, line, "Skipped: why")
    elif report.failed:  # the exception's own message (reprcrash), else the whole report, on one line
        crash = getattr(report.longrepr, "reprcrash", None)
        text = crash.message if crash is not None else (report.longreprtext or "")
        message = " | ".join(part.strip() for part in text.splitlines() if part.strip())[:600]
    row = dict(nodeid=report.nodeid, when=report.when, outcome=report.outcome, message=message)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="*", default=["tests"], help="pytest paths or node ids (default: tests)")
    ap.add_argument("--shards", type=int, default=os.cpu_count() or 4)
    ap.add_argument("--budget", type=float, default=540.0, help="seconds before every shard is killed")
    ap.add_argument("--marker", default="gpu", help="the pytest marker expression to run")
    ap.add_argument("--out", type=Path, default=Path("/tmp/gpu-tests"), help="shard logs and reports")
    ap.add_argument("--cwd", type=Path, default=ROOT, help="where pytest runs (default: the repository)")
    args = ap.parse_args()
    started = time.monotonic()
    ids = collect(args.paths, args.marker, args.cwd)
    if args.out.exists():
        shutil.rmtree(args.out)
    result = merge(run_shards(shard(ids, args.shards), args.budget, args.out.resolve(), args.cwd), ids)
    for failure in result["failures"]:
        print(json.dumps(dict(kind="gpu_test_failure", **failure)))
    counts = result["counts"]
    ran_on_gpu = counts["passed"] + counts["failed"] > 0
    summary = dict(
        summary=f"tests -m {args.marker}",
        collected=len(ids),
        shards=min(args.shards, len(ids)),
        **counts,
        skip_reasons=result["skip_reasons"],
        not_run_first=result["not_run"][:10],
        wall_s=round(time.monotonic() - started, 1),
    )
    print(json.dumps(summary))
    if not ran_on_gpu:
        print("nothing ran: every case skipped (not a CUDA machine?)", file=sys.stderr)
    sys.exit(0 if ran_on_gpu and not counts["failed"] and not counts["not_run"] else 1)


if __name__ == "__main__":
    main()
