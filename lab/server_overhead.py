"""What `kapitsa serve` costs a stream's decode: the same greedy request timed the same way (first
to last token as they arrive at the client) in process and through the server's HTTP stream,
with the sampling the server uses (the checkpoint's defaults, its EOS decay included: no
`ignore_eos`, which the OpenAI API does not have).

    python lab/server_overhead.py --model demo --tokens 128 --rounds 4
    python lab/server_overhead.py --shape nemotron-30b-a3b --speculative auto --ignore-eos   # GPU

The engines in process are as `--in-process` says, all open beside the server at once:
`plain` as `kapitsa run` and the TUI open one (no idle warm-up), `warm` as `kapitsa serve` and
`kapitsa bench` open one (decode batch sizes and prefill lengths readied while idle, waited for
before the rounds). On the H100 the bench's engine, then opened plain, decoded Nemotron at about
half of serve's speed in its first workload; the two show whether the warm-up is what differs. Each round times one request on every side, in an order
that turns from round to round, so a host whose speed drifts over minutes weighs on all sides
alike; the overhead is one minus served over in-process, medians of the rounds.

A side's round that made MLX's JIT compile (`jit_modules`: new modules in the disk cache all
these processes share) pays that compile, once, in whichever process reaches the shape first.

Where the time goes: CPU milliseconds per token of each thread of the side's process (from /proc,
Linux only; the busiest first: the engine thread, the event loop, MLX's and BLAS's workers), and
for the server the client's (this process, reading the stream), over the side's rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kapitsa.bench.local import until_warm
from kapitsa.engine.kernels.cuda_disk_cache import mlx_cache_dir
from kapitsa.engine.types import FinishEvent, GenerationRequest, SamplingParams, TokenEvent
from kapitsa.opener import open_engine
from lab.server_bench import free_port, server, wait_warm, write_checkpoint

MESSAGES = [
    {"role": "user", "content": "Write a long Python module with many small functions and docstrings."}
]


async def time_in_process(client, tokens: int, ignore_eos: bool = False) -> tuple[float, int]:  # noqa: ANN001
    # as the server builds it; ignore_eos only where asked (vLLM's extension, which the server takes)
    sampling = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=ignore_eos)
    first, count = None, 0
    async for event in client.generate(GenerationRequest(messages=tuple(MESSAGES), sampling=sampling)):
        if isinstance(event, TokenEvent) and event.token_ids:
            count += len(event.token_ids)
            first = first or time.perf_counter()
        elif isinstance(event, FinishEvent):
            return (count - 1) / (time.perf_counter() - first), count
    raise RuntimeError("no finish event")


def thread_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds of each thread of process `pid`, by thread id: the scheduler's nanoseconds on a
    CPU (`schedstat`), else user + system clock ticks (`stat`, 10 ms steps: a short round's thread
    may show none)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            with contextlib.suppress(OSError):
                out[int(task.name)] = int((task / "schedstat").read_text().split()[0]) / 1e9
                continue
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            out[int(task.name)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def time_over_http(url: str, tokens: int, ignore_eos: bool = False) -> tuple[float, int]:
    """(tok/s after the first text chunk, completion tokens by the final usage chunk)."""
    body = {"messages": MESSAGES, "max_tokens": tokens, "temperature": 0, "stream": True}
    body |= {"stream_options": {"include_usage": True}} | ({"ignore_eos": True} if ignore_eos else {})
    first, count = None, 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                count = chunk["usage"]["completion_tokens"]
            delta = (chunk.get("choices") or [{}])[0].get("delta") or {}
            if first is None and any(delta.get(k) for k in ("content", "reasoning_content", "reasoning")):
                first = time.perf_counter()
    return (count - 1) / (time.perf_counter() - first), count


class Side:
    """One way of running the request (an engine in this process, or the server over HTTP), its
    rounds' tok/s and the CPU its threads spent on them."""

    def __init__(self, name: str, run, pid: int) -> None:  # noqa: ANN001 - run(tokens) -> (tok/s, tokens)
        self.name, self.run, self.pid = name, run, pid
        self.tok_s: list[float] = []
        self.tokens = 0
        self.thread_cpu: dict[int, float] = {}  # CPU seconds per thread over the timed rounds
        self.client_cpu_s = 0.0  # this process's CPU over the served rounds (the HTTP client)
        # modules MLX's JIT wrote to its disk cache (every process here shares it) during each
        # round: a round that compiles pays for it once, in whichever process reaches it first
        self.jit_modules: list[int] = []

    def round(self, tokens: int) -> None:
        modules = _jit_modules()
        before, client = thread_cpu_s(self.pid), time.process_time()
        rate, count = self.run(tokens)
        after = thread_cpu_s(self.pid)
        self.jit_modules.append(_jit_modules() - modules)
        for thread, cpu in after.items():
            self.thread_cpu[thread] = self.thread_cpu.get(thread, 0.0) + cpu - before.get(thread, 0.0)
        self.client_cpu_s += time.process_time() - client
        self.tok_s.append(round(rate, 1))
        self.tokens += count

    def row(self) -> dict:
        per_token = sorted((1e3 * s / max(self.tokens, 1) for s in self.thread_cpu.values()), reverse=True)
        out = dict(side=self.name, tok_s=self.tok_s, tokens=self.tokens, jit_modules=self.jit_modules)
        out["median_tok_s"] = round(statistics.median(self.tok_s), 1)
        out["thread_cpu_ms_per_token"] = [round(ms, 2) for ms in per_token if ms > 0]
        if self.pid != os.getpid():
            out["client_cpu_ms_per_token"] = round(1e3 * self.client_cpu_s / max(self.tokens, 1), 2)
        return out


def _jit_modules() -> int:
    """Modules in MLX's JIT disk cache (0 where it has none: the CPU)."""
    folder = mlx_cache_dir()
    return sum(1 for _ in folder.rglob("*.ptx")) if folder is not None and folder.is_dir() else 0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--model", default="demo")
    which.add_argument(
        "--shape", help="a lab shape (lab/models_under_test.py), written as a checkpoint first"
    )
    parser.add_argument("--tiny", action="store_true", help="with --shape: small widths")
    parser.add_argument(
        "--in-process",
        nargs="+",
        choices=("plain", "warm"),
        default=["plain", "warm"],
        help="the engines in process: without the idle warm-up, with it (as serve and the bench)",
    )
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--speculative", default="none", help="both sides' mode (serve's default: auto)")
    parser.add_argument(
        "--ignore-eos", action="store_true", help="decode all --tokens (a random-weight model)"
    )
    args = parser.parse_args()
    if args.shape:
        work = Path(tempfile.gettempdir()) / "kapitsa-server-overhead"
        args.model = str(write_checkpoint(args.shape, work / f"shape-{args.shape}", args.tiny))
    port = free_port()
    argv = [sys.executable, "-m", "kapitsa", "serve", "--model", args.model, "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    log = Path(tempfile.gettempdir()) / "kapitsa-server-overhead.log"
    with contextlib.ExitStack() as stack:
        proc = stack.enter_context(
            server([*argv, "--speculative", args.speculative], f"{url}/health", log, 300)
        )
        sides = []
        for variant in args.in_process:
            engine = open_engine(args.model, speculative=args.speculative, warm_batches=variant == "warm")
            stack.callback(engine.close)
            warm_s = round(asyncio.run(until_warm(engine)), 1)  # the bench waits the same way
            print(json.dumps({"in_process": variant, "warm_up_s": warm_s}), flush=True)
            run = functools.partial(_run_in_process, engine, ignore_eos=args.ignore_eos)
            sides.append(Side(f"in process, {variant}", run, os.getpid()))
        print(json.dumps({"served": True, "warm_up_s": wait_warm(url, 600)}), flush=True)
        sides.append(
            Side("served", functools.partial(time_over_http, url, ignore_eos=args.ignore_eos), proc.pid)
        )
        for side in sides:
            side.run(8)  # one-time costs outside the timing
        # every side's rounds interleaved, the order turned each round: the host's speed drifts
        # over minutes (a fifth between rounds on one machine), more than the overhead to resolve
        for r in range(args.rounds):
            for side in sides[r % len(sides) :] + sides[: r % len(sides)]:
                side.round(args.tokens)
        rows = [side.row() for side in sides]
    for row in rows:
        print(json.dumps(row), flush=True)
    served = rows[-1]["median_tok_s"]
    print(
        json.dumps({f"overhead_vs_{r['side']}": round(1 - served / r["median_tok_s"], 4) for r in rows[:-1]})
    )


def _run_in_process(engine, tokens: int, ignore_eos: bool = False) -> tuple[float, int]:  # noqa: ANN001
    return asyncio.run(time_in_process(engine, tokens, ignore_eos))


if __name__ == "__main__":
    main()
