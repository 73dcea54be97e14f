"""Soak: concurrent mixed streams against `kapitsa serve` for N minutes, every SSE frame read strictly.

16 workers (by default) loop over streamed requests on all four APIs (chat, messages, responses,
completions), short and long prompts, some with tools; a share of the streams is cut by the client at a
random frame (right after the headers, mid-prefill, mid-answer). Counted: malformed SSE frames (bench/
soak_sse.py), streams that break their API's event order, streams that end without their last event,
non-200 answers. Afterwards the server must return to its baseline: no active or queued request, and
the memory in use (less the prefix cache, which keeps what it learnt) back where it started.

By default it writes a tiny random checkpoint and serves it with `python -m kapitsa serve` in a temporary
state folder; `--url` soaks a server that is already running (with `--api-key` if it needs one).

    python lab/soak.py --minutes 10                      # the figures issue 23 asks for
    python lab/soak.py --minutes 2 --streams 16          # a short run
    python lab/soak.py --url http://127.0.0.1:8484 --minutes 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from lab.soak_sse import ChatCheck, MessagesCheck, ResponsesCheck, SseReader, StreamCheck

CODE = "def merge(a, b):\n    out = []\n    while a and b:\n        out.append(a.pop(0) if a[0] < b[0] else b.pop(0))\n"
PROMPTS = ("Say hello.", "Explain this code:\n" + CODE, "Summarise:\n" + CODE * 12)
TOOLS = [{"name": "read", "description": "Read a file", "input_schema": {"type": "object", "properties": {}}}]


def request_for(rng: random.Random) -> tuple[str, str, dict[str, Any], StreamCheck]:
    """One streamed request: (api, path, body, the checker of its stream)."""
    api = rng.choice(("chat", "messages", "responses", "completions"))
    prompt, max_tokens = rng.choice(PROMPTS), rng.randint(8, 48)
    messages = [{"role": "user", "content": prompt}]
    if api == "chat":
        body = {"messages": messages, "max_tokens": max_tokens, "stream_options": {"include_usage": True}}
        return api, "/v1/chat/completions", body, ChatCheck("chat.completion.chunk")
    if api == "messages":
        body = {
            "messages": messages,
            "max_tokens": max_tokens,
            **({"tools": TOOLS} if rng.random() < 0.3 else {}),
        }
        return api, "/v1/messages", body, MessagesCheck()
    if api == "responses":
        return api, "/v1/responses", {"input": prompt, "max_output_tokens": max_tokens}, ResponsesCheck()
    return api, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens}, ChatCheck("text_completion")


class Tally:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.examples: list[str] = []

    def note(self, key: str, example: str | None = None) -> None:
        self.counts[key] += 1
        if example and len(self.examples) < 20:
            self.examples.append(f"{key}: {example}")


async def one_stream(client: httpx.AsyncClient, rng: random.Random, tally: Tally, cut_share: float) -> None:
    api, path, body, check = request_for(rng)
    cut_after = rng.choice((0, 1, 2, 3, 5, 8, 13)) if rng.random() < cut_share else None
    reader = SseReader()
    async with client.stream("POST", path, json={**body, "stream": True}) as response:
        if response.status_code != 200:
            tally.note(f"status {response.status_code}", (await response.aread()).decode()[:200])
            return
        async for chunk in _chunks_until(response, check, cut_after):
            for frame in reader.feed(chunk):
                check.add(frame)
        if cut_after is not None and not check.finished:
            tally.note("disconnects")
    tally.note(f"streams {api}")
    tally.counts["frames"] += check.frames
    tally.counts["malformed frames"] += reader.malformed
    for problem in reader.problems:
        tally.note("malformed examples", problem)
    if check.errors:
        tally.note("streams out of order", f"{api}: {check.errors[0]}")
    elif cut_after is None and not check.finished:
        tally.note("streams without their end", api)


async def _chunks_until(response: httpx.Response, check: StreamCheck, cut_after: int | None) -> Any:
    """The body's chunks until `cut_after` frames were read (0: none, a cut right after the headers)."""
    if cut_after == 0:
        return
    async for chunk in response.aiter_raw():
        yield chunk
        if cut_after is not None and check.frames >= cut_after:
            return


async def worker(
    url: str, headers: dict[str, str], deadline: float, seed: int, tally: Tally, cut: float
) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as client:
        while time.monotonic() < deadline:
            try:
                await one_stream(client, rng, tally, cut)
            except httpx.HTTPError as err:
                tally.note("transport errors", repr(err))


def metrics(url: str, headers: dict[str, str]) -> dict[str, float]:
    text = httpx.get(url + "/metrics", headers=headers, timeout=10).text
    pairs = (line.split(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    return {name: float(value) for name, value in pairs if "{" not in name}


def seconds_to_idle(url: str, headers: dict[str, str], within_s: float = 60.0) -> float | None:
    started = time.monotonic()
    while time.monotonic() - started < within_s:
        now = metrics(url, headers)
        if now["kapitsa_active_requests"] == 0 and now["kapitsa_queued_requests"] == 0:
            return round(time.monotonic() - started, 2)
        time.sleep(0.1)
    return None


def memory_less_cache(m: dict[str, float]) -> float:
    return m["kapitsa_memory_in_use_bytes"] - m["kapitsa_checkpoint_bytes_in_memory"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def tiny_server(kind: str) -> Iterator[str]:
    """`python -m kapitsa serve` over a fresh tiny checkpoint, in a temporary state folder."""
    from kapitsa.testing.tiny import write_tiny_checkpoint

    with tempfile.TemporaryDirectory(prefix="kapitsa-soak-") as tmp:
        folder = write_tiny_checkpoint(Path(tmp) / "tiny", kind)  # type: ignore[arg-type]
        port = _free_port()
        env = {**os.environ, "KAPITSA_STATE_DIR": f"{tmp}/state", "KAPITSA_CONFIG": f"{tmp}/none.toml"}
        command = [sys.executable, "-m", "kapitsa", "serve", "--model", str(folder), "--port", str(port)]
        proc = subprocess.Popen(command, env=env, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_until_up(url, proc)
            yield url
        finally:
            proc.terminate()
            proc.wait(timeout=60)


def _wait_until_up(url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            httpx.get(url + "/health", timeout=2).raise_for_status()
            return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise RuntimeError("kapitsa serve did not start")


async def soak(url: str, headers: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    tally = Tally()
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as client:
        await one_stream(client, random.Random(0), Tally(), 0)  # warm-up: compiled paths, first allocations
    seconds_to_idle(url, headers)
    before = metrics(url, headers)
    deadline = time.monotonic() + args.minutes * 60
    seeds = range(args.seed, args.seed + args.streams)
    await asyncio.gather(*(worker(url, headers, deadline, s, tally, args.cut) for s in seeds))
    idle_s = seconds_to_idle(url, headers)
    after = metrics(url, headers)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as client:
        still = await client.post("/v1/completions", json={"prompt": "ok", "max_tokens": 1})
    return {
        "minutes": args.minutes,
        "streams": args.streams,
        **dict(sorted(tally.counts.items())),
        "seconds to idle after the run": idle_s,
        "a request after the run": still.status_code,
        "memory less prefix cache, MB before/after": [
            round(memory_less_cache(before) / 2**20, 1),
            round(memory_less_cache(after) / 2**20, 1),
        ],
        "requests failed in the engine": after["kapitsa_requests_failed_total"]
        - before["kapitsa_requests_failed_total"],
        "examples": tally.examples,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--streams", type=int, default=16, help="concurrent streams")
    parser.add_argument("--cut", type=float, default=0.25, help="share of streams the client cuts")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--url", help="a running server (default: serve a tiny checkpoint)")
    parser.add_argument("--api-key")
    parser.add_argument("--kind", default="qwen3_5", help="tiny checkpoint kind (qwen3_5, nemotron_h, ...)")
    args = parser.parse_args()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    if args.url:
        report = asyncio.run(soak(args.url, headers, args))
    else:
        with tiny_server(args.kind) as url:
            report = asyncio.run(soak(url, headers, args))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
