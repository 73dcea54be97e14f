"""What `kapitsa serve` costs a stream's decode: the same greedy request timed the same way (first
to last token as they arrive at the client) in process and through the server's HTTP stream,
with the sampling the server uses (the checkpoint's defaults, its EOS decay included: no
`ignore_eos`, which the OpenAI API does not have).

    python lab/server_overhead.py --model demo --tokens 128 --rounds 4
    python lab/server_overhead.py --shape nemotron-30b-a3b --speculative auto --ignore-eos   # GPU

The engine in process runs as `--in-process` says, each its own engine one after the other:
`plain` as `kapitsa bench` opens it (no idle warm-up), `warm` as `kapitsa serve` opens it (its
decode batch sizes and prefill lengths readied while idle, waited for before the rounds). On the
H100 the bench's plain engine decoded Nemotron at about half of serve's speed; the two show
whether the warm-up is what differs.

Where the time goes on a small machine: CPU milliseconds per token of the client (this process,
reading the stream) and of each of the server's threads (from /proc, Linux only; the busiest
first: the engine thread, the event loop, MLX's and BLAS's workers), over the served rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kapitsa.engine.types import FinishEvent, GenerationRequest, SamplingParams, TokenEvent
from kapitsa.opener import hand_back_memory, open_engine
from lab.server_bench import free_port, server, write_checkpoint

MESSAGES = [
    {"role": "user", "content": "Write a long Python module with many small functions and docstrings."}
]


async def _in_process(client, tokens: int, ignore_eos: bool = False) -> tuple[float, int]:  # noqa: ANN001
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


def _thread_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of process `pid`, by thread id."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            out[int(task.name)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def _cpu_ms_per_token(before: dict[int, float], after: dict[int, float], tokens: int) -> list[float]:
    """Each thread's CPU milliseconds per token over the interval, busiest first (idle ones left out)."""
    used = sorted((after[t] - before.get(t, 0.0) for t in after), reverse=True)
    return [round(1e3 * s / tokens, 2) for s in used if s > 0]


def _over_http(url: str, tokens: int, ignore_eos: bool = False) -> tuple[float, int]:
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


def _until_warm(engine, timeout_s: float = 600.0) -> float:  # noqa: ANN001 - an InProcessEngine
    """Seconds until the engine's idle warm-up has nothing pending (none: at once)."""
    started = time.monotonic()
    while engine.stats().warm_batches_pending and time.monotonic() - started < timeout_s:
        time.sleep(0.1)
    return round(time.monotonic() - started, 1)


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
        help="the engines in process: as the bench opens one, as serve does",
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
    rows = {}
    for variant in args.in_process:
        engine = open_engine(args.model, speculative=args.speculative, warm_batches=variant == "warm")
        with contextlib.closing(engine):
            warm_s = _until_warm(engine)
            asyncio.run(_in_process(engine, 8))  # one-time costs outside the timing, as for the server
            threads = _thread_cpu_s(os.getpid())
            local = [
                asyncio.run(_in_process(engine, args.tokens, args.ignore_eos)) for _ in range(args.rounds)
            ]
            local_ms = _cpu_ms_per_token(threads, _thread_cpu_s(os.getpid()), sum(n for _, n in local))
        hand_back_memory()  # the next engine and the server may share this device
        rows[variant] = dict(
            tok_s=[round(x, 1) for x, _ in local],
            tokens=[n for _, n in local],
            thread_cpu_ms_per_token=local_ms,
            warm_up_s=warm_s,
        )
        print(json.dumps({"in_process": variant, **rows[variant]}), flush=True)
    port = free_port()
    argv = [sys.executable, "-m", "kapitsa", "serve", "--model", args.model, "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    log = Path(tempfile.gettempdir()) / "kapitsa-server-overhead.log"
    with server([*argv, "--speculative", args.speculative], f"{url}/health", log, timeout_s=120) as proc:
        _over_http(url, 8)  # the server's first request pays its one-time costs outside the timing
        threads, client = _thread_cpu_s(proc.pid), time.process_time()
        served = [_over_http(url, args.tokens, args.ignore_eos) for _ in range(args.rounds)]
        tokens = sum(n for _, n in served)
        client_ms = 1e3 * (time.process_time() - client) / tokens
        server_ms = _cpu_ms_per_token(threads, _thread_cpu_s(proc.pid), tokens)
    print(
        json.dumps(
            dict(
                in_process={variant: row["tok_s"] for variant, row in rows.items()},
                served_tok_s=[round(x, 1) for x, _ in served],
                served_tokens=[n for _, n in served],
                client_cpu_ms_per_token=round(client_ms, 2),
                server_thread_cpu_ms_per_token=server_ms,
            )
        )
    )


if __name__ == "__main__":
    main()
