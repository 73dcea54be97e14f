"""The server's own CPU per streamed token, without a model: a scripted engine (`FakeEngine`) replies
with N one-token chunks at once, and the app streams them to a client in this process (httpx's
ASGI transport: no socket). What remains per token is the route's work: events through the
generation's queues, the chunk's JSON, the SSE framing, Starlette's streaming response.

    python lab/server_token_cost.py --tokens 2000 [--api chat|messages|responses] [--profile 15]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import time

import httpx

from kapitsa.server.app import create_app
from kapitsa.testing.fake_engine import FakeEngine

ROUTES = {
    "chat": (
        "/v1/chat/completions",
        lambda n: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": n},
    ),
    "messages": (
        "/v1/messages",
        lambda n: {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": n},
    ),
    "responses": ("/v1/responses", lambda n: {"model": "fake", "input": "hi", "max_output_tokens": n}),
}


async def _stream(app, api: str, tokens: int) -> int:  # noqa: ANN001 - the FastAPI app
    path, body = ROUTES[api]
    transport = httpx.ASGITransport(app=app)
    lines = 0
    async with (
        httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as client,
        client.stream("POST", path, json={**body(tokens), "stream": True}) as response,
    ):
        if response.status_code != 200:
            raise SystemExit(f"{path}: HTTP {response.status_code} {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            lines += line.startswith("data:")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--api", choices=sorted(ROUTES), default="chat")
    parser.add_argument("--profile", type=int, default=0, help="print the N costliest functions")
    args = parser.parse_args()
    engine = FakeEngine()
    app = create_app(engine)
    engine.enqueue(["x"] * 8)
    asyncio.run(_stream(app, args.api, 8))  # imports and first-request costs outside the timing
    engine.enqueue(["x"] * args.tokens)
    profiler = cProfile.Profile() if args.profile else None
    wall, cpu = time.perf_counter(), time.process_time()
    if profiler:
        profiler.enable()
    lines = asyncio.run(_stream(app, args.api, args.tokens))
    if profiler:
        profiler.disable()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print(
        json.dumps(
            dict(
                api=args.api,
                tokens=args.tokens,
                sse_lines=lines,
                cpu_us_per_token=round(1e6 * cpu / args.tokens, 1),
                wall_us_per_token=round(1e6 * wall / args.tokens, 1),
            )
        )
    )
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)


if __name__ == "__main__":
    main()
