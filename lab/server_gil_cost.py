"""What streaming through `kapitsa serve` takes from a host-bound engine, without a model.

On a GPU at batch 1 the engine thread is host-bound: it spends each step in Python and in MLX's
dispatch, holding the GIL. Everything the server's event loop does per token (the hand-off from
the engine thread, the route's queues, the chunk's JSON, the HTTP write) runs under the same GIL,
so it comes out of the engine's step time. Here an engine thread (`PacedEngine`) spends
`--step-ms` of pure Python per token, as such an engine does, and hands each token to the event
loop the way the real one does (`threadsafe_put`). The same requests are timed two ways, in
interleaved rounds:

- in process: a coroutine in this process reads `generate`, as `kapitsa run` and the bench do;
- served: `kapitsa serve`'s app (`server.runner.make_server`: uvicorn with the engine above) in a
  child process, read by this process over a loopback socket as a streaming client.

The overhead is one minus served over in-process tok/s (medians of the rounds); with it, the
server's event-loop CPU per token (from /proc, Linux).

    python lab/server_gil_cost.py --step-ms 4 --tokens 256 --rounds 6 [--wait-ms 1] [--loop asyncio]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

from kapitsa.engine.runner.output import threadsafe_put
from kapitsa.engine.types import Event, FinishEvent, GenerationRequest, TokenEvent, Usage
from kapitsa.testing.fake_engine import FakeEngine
from lab.server_bench import free_port, server
from lab.server_overhead import thread_cpu_s, time_in_process, time_over_http

WORD = "tok "


def _spin(seconds: float) -> None:
    """Python work under the GIL for `seconds` (an engine thread's host-bound step)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class PacedEngine(FakeEngine):
    """Tokens from an engine thread of its own, each after `step_s` of Python work."""

    def __init__(self, step_s: float, wait_s: float) -> None:
        super().__init__()
        self.step_s, self.wait_s = step_s, wait_s

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Event]:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        put, stop = threadsafe_put(loop, events), threading.Event()
        tokens = request.sampling.max_tokens or 16

        def work() -> None:
            for index in range(tokens):
                if stop.is_set():
                    break
                _spin(self.step_s)
                time.sleep(self.wait_s)  # the device's tail of the step: the GIL is free
                put(TokenEvent(request.request_id, (index,), WORD))
            put(FinishEvent(request.request_id, "length", Usage(completion_tokens=tokens)))

        threading.Thread(target=work, daemon=True, name="paced-engine").start()
        try:
            while not isinstance(event := await events.get(), FinishEvent):
                yield event
            yield event
        finally:
            stop.set()


def _serve(port: int, step_s: float, wait_s: float, loop: str) -> None:
    from kapitsa.server.runner import make_server
    from kapitsa.server.settings import ServerSettings

    server = make_server(PacedEngine(step_s, wait_s), ServerSettings(port=port))
    server.config.loop = loop  # serve's own choice unless asked ("auto": uvloop where installed)
    server.run()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--step-ms", type=float, default=4.0, help="the engine's Python work per token")
    parser.add_argument(
        "--wait-ms", type=float, default=0.0, help="then its wait for the device per token (GIL released)"
    )
    parser.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # the child: serve on this port
    args = parser.parse_args()
    step_s, wait_s = args.step_ms / 1e3, args.wait_ms / 1e3
    if args.serve:
        return _serve(args.serve, step_s, wait_s, args.loop)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, __file__, "--serve", str(port), "--step-ms", str(args.step_ms)]
    argv += ["--wait-ms", str(args.wait_ms), "--loop", args.loop]
    log = Path(tempfile.gettempdir()) / "kapitsa-server-gil-cost.log"
    with server(argv, f"{url}/health", log, 60) as child:
        engine = PacedEngine(step_s, wait_s)
        time_over_http(url, 8)
        served, local, server_cpu = [], [], 0.0
        for r in range(args.rounds):
            order = [0, 1] if r % 2 == 0 else [1, 0]
            for side in order:
                if side == 0:
                    local.append(asyncio.run(time_in_process(engine, args.tokens))[0])
                    continue
                before = thread_cpu_s(child.pid)
                served.append(time_over_http(url, args.tokens)[0])
                after = thread_cpu_s(child.pid)
                # the child's threads other than its paced engine threads (one per request, gone by now)
                server_cpu += sum(cpu - before.get(tid, 0.0) for tid, cpu in after.items() if tid in before)
        row = {
            "step_ms": args.step_ms,
            "wait_ms": args.wait_ms,
            "loop": args.loop,
            "in_process_tok_s": round(statistics.median(local), 1),
            "served_tok_s": round(statistics.median(served), 1),
            "ideal_tok_s": round(1 / (step_s + wait_s), 1),
            "server_threads_cpu_ms_per_token": round(1e3 * server_cpu / (args.rounds * args.tokens), 3),
        }
        row["overhead"] = round(1 - row["served_tok_s"] / row["in_process_tok_s"], 4)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
