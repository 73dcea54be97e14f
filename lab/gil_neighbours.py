"""One stream's decode while another thread of the process runs Python, at two GIL switch intervals.

The engine thread gives the GIL up whenever MLX waits on the device (or, here, on its CPU worker)
and then waits for it while another thread holds it: up to the switch interval, at every such
wait. In `kapitsa serve` that other thread is a request being prepared (its chat template rendered
and tokenized: `neighbour=prepare`, a long agent conversation counted again and again through the
engine's own `count_tokens`) or plain Python (`neighbour=spin`). Rounds alternate between Python's
default interval (5 ms) and the engine's (`EngineConfig.gil_switch_interval_s`, 1 ms), each with no
neighbour, then with each neighbour.

    python lab/gil_neighbours.py --model demo --tokens 128 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time

from kapitsa.engine.types import GenerationRequest, SamplingParams
from kapitsa.opener import open_engine
from lab.server_overhead import time_in_process


def agent_conversation(turns: int) -> tuple[dict, ...]:
    """A long agent conversation (its template renders in Python each time it is prepared)."""
    text = "Read the file, then change the function so that it handles the empty case. " * 20
    messages = [{"role": "system", "content": "You are a coding agent. " * 50}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Turn {turn}. {text}"})
        messages.append({"role": "assistant", "content": f"Done with turn {turn}. {text}"})
    messages.append({"role": "user", "content": "Now run the tests."})
    return tuple(messages)


class Neighbour:
    """Another thread of the process, busy until stopped."""

    def __init__(self, kind: str, client, conversation: tuple[dict, ...]) -> None:  # noqa: ANN001
        self.kind, self.client, self.conversation = kind, client, conversation
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.prepared = 0

    def __enter__(self) -> Neighbour:
        self.thread.start()
        time.sleep(0.1)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()

    def _run(self) -> None:
        if self.kind == "spin":
            while not self.stop.is_set():
                sum(range(1000))
            return
        request = GenerationRequest(messages=self.conversation, sampling=SamplingParams(max_tokens=1))

        async def prepare_again() -> None:
            while not self.stop.is_set():
                await self.client.count_tokens(request)
                self.prepared += 1

        asyncio.run(prepare_again())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="demo")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--turns", type=int, default=40, help="the prepared conversation's turns")
    args = parser.parse_args()
    client = open_engine(args.model, speculative="none")
    conversation = agent_conversation(args.turns)
    try:
        asyncio.run(time_in_process(client, 8, ignore_eos=True))
        started = time.perf_counter()
        prompt_tokens = asyncio.run(
            client.count_tokens(GenerationRequest(messages=conversation, sampling=SamplingParams()))
        )
        prepare_ms = 1e3 * (time.perf_counter() - started)
        print(json.dumps({"prepared_prompt_tokens": prompt_tokens, "prepare_ms": round(prepare_ms, 1)}))
        rates: dict[str, list[float]] = {}
        for _ in range(args.rounds):
            for interval in (0.005, 0.001):
                sys.setswitchinterval(interval)
                for kind in ("none", "prepare", "spin"):
                    key = f"interval {interval * 1e3:g} ms, neighbour {kind}"
                    if kind == "none":
                        rate, _ = asyncio.run(time_in_process(client, args.tokens, ignore_eos=True))
                    else:
                        with Neighbour(kind, client, conversation):
                            rate, _ = asyncio.run(time_in_process(client, args.tokens, ignore_eos=True))
                    rates.setdefault(key, []).append(round(rate, 1))
        for key, values in rates.items():
            print(json.dumps({"case": key, "tok_s": values, "median_tok_s": statistics.median(values)}))
    finally:
        client.close()


if __name__ == "__main__":
    main()
