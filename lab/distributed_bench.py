"""Decode and prefill speed of one model across a group of local ranks against one process.

Runs `kapitsa run --json` on the model: in one process (the normal engine, speculation off), then
through `--hostfile` with 1, 2, ... ranks on 127.0.0.1 (ring backend) in pipeline and tensor mode.
Each configuration runs `--repeats` times, alternating; the medians go to stdout as a markdown
table, every run's JSON to the log (`--log`, default lab/runs/distributed-cpu.log).

    .venv/bin/python lab/distributed_bench.py --model kapitsa/demo --tokens 128 --ranks 1,2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# the cost of one tiny all_sum between local ranks: what each group step pays per collective
LATENCY = """
import time, mlx.core as mx
g = mx.distributed.init(strict=True, backend="ring")
x = mx.zeros((12,), dtype=mx.int32)
for _ in range(20): mx.eval(mx.distributed.all_sum(x))
t = time.perf_counter()
for _ in range(300): mx.eval(mx.distributed.all_sum(x))
if g.rank() == 0: print(round((time.perf_counter() - t) / 300 * 1e6, 1))
"""
LAUNCH = (
    "import sys; from mlx._distributed_utils.launch import main; sys.argv[0] = 'mlx.launch'; sys.exit(main())"
)
PROMPT = "Write a long story about a lighthouse keeper who finds a map in a bottle. " * 8


def run_once(model: str, tokens: int, hostfile: Path | None, parallel: str) -> dict:
    group = [] if hostfile is None else ["--hostfile", str(hostfile), "--parallel", parallel]
    command = [sys.executable, "-m", "kapitsa", "run", *group, "-m", model, "--raw", "--json"]
    command += ["--max-tokens", str(tokens), "--speculative", "none", PROMPT]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, start_new_session=True)
    if done.returncode != 0:  # a split the model does not divide into: reported, not timed
        error = next(
            (line for line in done.stderr.splitlines() if line.startswith("error:")), done.stderr[-300:]
        )
        return {"error": error, "wall_s": round(time.perf_counter() - started, 2)}
    line = next(line for line in done.stdout.splitlines() if line.startswith("{"))
    return json.loads(line) | {"wall_s": round(time.perf_counter() - started, 2)}


def all_sum_latency_us(ranks: int) -> float:
    command = [sys.executable, "-c", LAUNCH, "--backend", "ring", "-n", str(ranks), "--"]
    done = subprocess.run(
        [*command, sys.executable, "-c", LATENCY], capture_output=True, text=True, timeout=300
    )
    return float(done.stdout.strip().splitlines()[-1])


def hostfile(folder: Path, ranks: int) -> Path:
    path = folder / f"hosts{ranks}.json"
    path.write_text(json.dumps([{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}] * ranks))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="kapitsa/demo")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--ranks", default="1,2", help="comma list of group sizes")
    parser.add_argument("--modes", default="pipeline,tensor")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--log", type=Path, default=Path("lab/runs/distributed-cpu.log"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        configs = [("one process", None, "-")]
        for ranks in map(int, args.ranks.split(",")):
            for mode in args.modes.split(","):
                configs.append((f"{ranks} rank(s), {mode}", hostfile(Path(folder), ranks), mode))
        results: dict[str, list[dict]] = {name: [] for name, _, _ in configs}
        for _ in range(args.repeats):
            for name, hosts, mode in configs:
                if not results[name] or "error" not in results[name][0]:
                    results[name].append(run_once(args.model, args.tokens, hosts, mode))
    latency = {n: all_sum_latency_us(n) for n in map(int, args.ranks.split(",")) if n > 1}
    report(args, results, latency)


def report(args: argparse.Namespace, results: dict[str, list[dict]], latency: dict[int, float]) -> None:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    lines = [
        f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} commit={commit} model={args.model} tokens={args.tokens}",
        "| configuration | decode tok/s | prefill tok/s | tokens | wall s |",
        "|---|---|---|---|---|",
    ]
    for name, runs in results.items():
        if "error" in runs[0]:
            lines.append(f"| {name} | {runs[0]['error']} | | | |")
            continue
        med = {k: statistics.median(r[k] for r in runs) for k in ("decode_tok_s", "prefill_tok_s", "wall_s")}
        generated = runs[0]["generation_tokens"]
        lines.append(
            f"| {name} | {med['decode_tok_s']:.1f} | {med['prefill_tok_s']:.1f} | {generated} | {med['wall_s']:.1f} |"
        )
    lines += [f"all_sum of 12 int32 over {n} local ranks: {us} us" for n, us in latency.items()]
    print("\n".join(lines))
    args.log.parent.mkdir(parents=True, exist_ok=True)
    with args.log.open("a") as log:
        log.write("\n".join(lines) + "\n")
        for name, runs in results.items():
            for run in runs:
                log.write(
                    json.dumps({"config": name, **{k: v for k, v in run.items() if k != "text"}}) + "\n"
                )


if __name__ == "__main__":
    main()
