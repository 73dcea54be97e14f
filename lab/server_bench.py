"""Speed as an HTTP client sees it: `kapitsa serve` against `mlx_lm.server` on the same checkpoint,
beside kapitsa's engine in process (what the server adds), with `kapitsa bench`'s workloads.

    python lab/server_bench.py --shape 27b              # a random-weight 4-bit real shape (H200)
    python lab/server_bench.py --shape 4b --tiny        # the same at small widths (any machine)
    python lab/server_bench.py --model demo             # a real checkpoint (here: the embedded demo)

Each server runs as its own process, started as a user starts it (`python -m kapitsa serve`,
`python -m mlx_lm.server`), on the same folder (lab/shape_checkpoint.py writes one both load).
The engines run one after another, each alone on the machine: the in-process engine (not with
`--no-local`), then `kapitsa serve` (timed from start to listening, then to the end of its idle
warm-up of decode batch sizes, read from its /metrics, before its first request), with
`--plain-serve` a second one without speculation, then mlx_lm.server. The checkpoint is written by
a process of its own first. Greedy decoding; `--speculative` (default: serve's own, `auto`) is
kapitsa's mode in process and in its server; `--workloads` picks the bench's workloads.
All three use this machine's one MLX JIT cache (`$MLX_PTX_CACHE_DIR`, else MLX's default folder),
so a server does not compile again what the engine before it compiled: `kapitsa serve` otherwise
keeps its own cache in kapitsa's state folder, empty on a fresh machine (a first start's compiles
are `lab/startup_compile.py`'s to measure). Each server answers one short untimed request before
the workloads (its time is reported), so its first workload does not carry one-time compiles.
Prints the bench report's JSON, then one `summary` line: decode tok/s and time to first token per
engine, kapitsa server / mlx_lm.server, and the server's overhead against the in-process engine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from kapitsa.bench.runner import WORKLOAD_NAMES
from kapitsa.engine.options import DEFAULT_SPECULATIVE

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(argv: list[str], ready_url: str, log: Path, timeout_s: float) -> Iterator[subprocess.Popen]:
    """A server process, up once `ready_url` answers 200; stopped (then killed) on exit."""
    # mlx_lm.server's /v1/models scans the Hugging Face cache and fails when it doesn't exist
    hub = Path(os.environ.get("HF_HUB_CACHE") or log.parent / "hf-hub")
    hub.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)])),
        "HF_HUB_CACHE": str(hub),
    }
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        start = time.monotonic()
        _wait_ready(proc, ready_url, log, timeout_s)
        proc.ready_s = time.monotonic() - start  # from start to answering
        label = f"kapitsa {argv[3]}" if argv[1] == "-c" else " ".join(argv[1:4])  # -c LOGGED_KAPITSA serve
        _progress(f"{label} ready after {proc.ready_s:.1f} s")
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()


def _progress(line: str) -> None:
    """Where the time went, printed as it goes: a run cut by its limit still says how far it got."""
    print(line, file=sys.stderr, flush=True)


def _wait_ready(proc: subprocess.Popen, url: str, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:4]} exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready after {timeout_s:.0f} s:\n{log.read_text()[-3000:]}")


def share_jit_cache() -> None:
    """Point every process this bench starts at the one JIT cache MLX uses in this process."""
    from kapitsa.engine.kernels.cuda_disk_cache import mlx_cache_dir

    if "MLX_PTX_CACHE_DIR" not in os.environ:
        os.environ["MLX_PTX_CACHE_DIR"] = str(mlx_cache_dir())


def first_request_s(url: str) -> float:
    """Seconds a server takes to stream an 8-token answer to a short prompt (its first request)."""
    from kapitsa.bench.targets import HttpTarget

    async def once() -> float:
        target = HttpTarget(f"{url}/v1")
        try:
            await target.prepare()
            result = await target.complete([{"role": "user", "content": "Say hello."}], max_tokens=8)
            return round(result.total_s, 2)
        finally:
            await target.aclose()

    return asyncio.run(once())


def _metric(url: str, name: str) -> float | None:
    """One gauge of a kapitsa server's /metrics (Prometheus text)."""
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    return None


def wait_warm(url: str, timeout_s: float) -> float | None:
    """Wait until a kapitsa server has readied its decode batch sizes; the seconds it spent on them."""
    deadline = time.monotonic() + timeout_s
    while (_metric(url, "kapitsa_warm_batches_pending") or 0) > 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    return _metric(url, "kapitsa_warmup_seconds")


def bench_config(args: argparse.Namespace):  # noqa: ANN201 - BenchConfig
    from kapitsa.bench.workloads import BenchConfig

    return BenchConfig(
        short_prompt_words=40,
        long_prompt_words=args.long_words,
        decode_tokens=args.tokens,
        replay_turns=args.replay_turns,
        replay_context_words=args.replay_words,
        concurrent_streams=args.streams,
        concurrent_tokens=args.tokens,
    )


def run_bench(model: str | None, urls: list[str], args: argparse.Namespace) -> dict:
    """The bench's report on the in-process engine of `model` (None: none) and on `urls`."""
    from kapitsa.bench.command import BenchOptions, collect_report
    from kapitsa.bench.submit import report_json

    options = BenchOptions(
        model=model,
        compare=tuple(urls),
        local=model is not None,
        speculative=args.speculative,
        workloads=tuple(args.workloads),
    )
    report = asyncio.run(collect_report(options, bench_config(args)))
    return json.loads(report_json(report))


def metric(report: dict, engine: str, workload: str, name: str) -> float | None:
    for e in report["engines"]:
        if e["name"] != engine:
            continue
        for w in e["workloads"]:
            if w["name"] == workload and w["status"] == "ok" and name in w["metrics"]:
                value = w["metrics"][name]
                return value["value"] if isinstance(value, dict) else value
    return None


# `python -m kapitsa` with the engine's INFO lines (its warm-up per batch size, each kernel compiled
# into the disk cache, with times) in the server's log, where a slow start shows what it spent on.
LOGGED_KAPITSA = (
    "import logging, runpy, sys; sys.argv[0] = 'kapitsa'; "
    "logging.basicConfig(level=logging.INFO, format='%(asctime)s %(name)s %(message)s'); "
    "runpy.run_module('kapitsa', run_name='__main__')"
)

SERVE, PLAIN_SERVE, MLX_LM = "kapitsa serve", "kapitsa serve --speculative none", "mlx_lm.server"
LOCAL = "kapitsa engine"  # in process


def named(report: dict, name: str) -> dict:
    """`report` with its engines (one each run) called `name`."""
    for engine in report["engines"]:
        engine["name"] = name
    return report


def summary(report: dict) -> dict:
    names = [e["name"] for e in report["engines"]]
    rows = {
        n: {
            "decode_tok_s": metric(report, n, "decode_short", "decode_tok_s"),
            "ttft_s": metric(report, n, "decode_short", "ttft_s"),
            "concurrent_tok_s": metric(report, n, "concurrent_4", "aggregate_tok_s"),
            "replay_mean_ttft_s": metric(report, n, "agent_replay", "mean_ttft_s"),
            "replay_cache_hit_pct": metric(report, n, "agent_replay", "cache_hit_pct"),
            "ttft_cold_s": metric(report, n, "ttft_cold_warm", "ttft_cold_s"),
            "prefill_tok_s": metric(report, n, "prefill", "prefill_tok_s"),
        }
        for n in names
    }
    local, ours, theirs = (rows.get(n, {}).get("decode_tok_s") for n in (LOCAL, SERVE, MLX_LM))
    out = {"summary": rows}
    if local and ours:
        out["server_overhead"] = round(1 - ours / local, 4)
    if ours and theirs:
        out["kapitsa_serve_vs_mlx_lm_server"] = round(ours / theirs, 3)
    ours8, theirs8 = (rows.get(n, {}).get("concurrent_tok_s") for n in (SERVE, MLX_LM))
    if ours8 and theirs8:
        out["streams_serve_vs_mlx_lm_server"] = round(ours8 / theirs8, 3)
    return out


def write_checkpoint(shape: str, folder: Path, tiny: bool) -> Path:
    """The shape's random-weight folder, written by its own process: this one keeps no buffers of
    it, and the engine in process starts as a user's would."""
    start = time.monotonic()
    argv = [sys.executable, "-m", "lab.shape_checkpoint", shape, str(folder), *(["--tiny"] if tiny else [])]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)])),
    }
    subprocess.run(argv, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    _progress(f"checkpoint {folder} written in {time.monotonic() - start:.1f} s")
    return folder


def serve_and_bench(
    argv: list[str], url: str, log: Path, name: str, args: argparse.Namespace
) -> tuple[dict, dict]:
    """One `kapitsa serve`'s start, warm-up and bench; its report and its start-up figures."""
    key = name.replace("kapitsa serve", "kapitsa_serve").replace(" --speculative none", "_plain")
    start = {}
    with server(argv, f"{url}/health", log, args.ready_timeout) as proc:
        start[f"{key}_ready_s"] = round(proc.ready_s, 1)
        start[f"{key}_warmup_s"] = wait_warm(url, args.ready_timeout)
        _progress(f"{name} warmed its batch sizes in {start[f'{key}_warmup_s']} s")
        start[f"{key}_first_request_s"] = first_request_s(url)
        report = named(run_bench(None, [url], args), name)
        for counter in ("speculative_verifies", "draft_tokens_proposed", "draft_tokens_accepted"):
            start[f"{key}_{counter}"] = _metric(url, f"kapitsa_{counter}_total")  # the whole bench
    return report, start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--shape", help="a lab shape (lab/models_under_test.py), written as a checkpoint")
    which.add_argument("--model", help="a checkpoint kapitsa and mlx-lm both load (folder, or `demo`)")
    parser.add_argument("--tiny", action="store_true", help="with --shape: small widths")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--long-words", type=int, default=3000)
    parser.add_argument("--replay-turns", type=int, default=6)
    parser.add_argument("--replay-words", type=int, default=1500)
    parser.add_argument(
        "--speculative", default=DEFAULT_SPECULATIVE, help="kapitsa's mode (default: serve's)"
    )
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "kapitsa-server-bench")
    parser.add_argument(
        "--workloads",
        nargs="+",
        choices=WORKLOAD_NAMES,
        default=list(WORKLOAD_NAMES),
        help="the bench's workloads to run (default: all; `kapitsa bench --workload`)",
    )
    parser.add_argument("--no-local", action="store_true", help="leave out the engine in process")
    parser.add_argument(
        "--plain-serve", action="store_true", help="also a `kapitsa serve --speculative none`, after serve"
    )
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    share_jit_cache()  # before this process's first compile: MLX reads the variable then
    folder = Path(args.model) if args.model and args.model != "demo" else None
    if args.shape:
        folder = write_checkpoint(args.shape, args.work / f"shape-{args.shape}", args.tiny)
    if folder is None:  # the embedded demo checkpoint (the package's demo/ folder), which mlx-lm also loads
        import kapitsa

        folder = Path(kapitsa.__file__).parent / "demo"
    py = sys.executable
    from lab.cpu_vs_mlxlm import _mlxlm_folder  # the demo's model_type as mlx-lm names it

    mlx_folder = _mlxlm_folder(folder, Path(tempfile.mkdtemp(dir=args.work)))
    report = {"engines": []} if args.no_local else named(run_bench(str(folder), [], args), LOCAL)
    start = {}
    for name, mode in ((SERVE, args.speculative), *([(PLAIN_SERVE, "none")] if args.plain_serve else [])):
        port = free_port()
        argv = [
            py,
            "-c",
            LOGGED_KAPITSA,
            "serve",
            "--model",
            str(folder),
            "--port",
            str(port),
            "--speculative",
            mode,
        ]
        log = args.work / ("kapitsa-plain.log" if name == PLAIN_SERVE else "kapitsa.log")
        served, figures = serve_and_bench(argv, f"http://127.0.0.1:{port}", log, name, args)
        report["engines"] += served["engines"]
        start |= figures
    port = free_port()
    mlx_argv = [py, "-m", "mlx_lm.server", "--model", str(mlx_folder), "--port", str(port)]
    mlx_url = f"http://127.0.0.1:{port}"
    with server(mlx_argv, f"{mlx_url}/v1/models", args.work / "mlx_lm.log", args.ready_timeout) as proc:
        start["mlx_lm_server_ready_s"] = round(proc.ready_s, 1)
        start["mlx_lm_server_first_request_s"] = first_request_s(mlx_url)
        report["engines"] += named(run_bench(None, [mlx_url], args), MLX_LM)["engines"]
    totals = summary(report) | start
    print(json.dumps(report))
    print(json.dumps(totals))


if __name__ == "__main__":
    main()
