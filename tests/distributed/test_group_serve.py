"""`kapitsa serve --hostfile`: the openai SDK gets from a group of local ranks what one process
answers, and killing a rank mid-stream ends both running streams with an error and every rank
within 10 s."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.distributed.conftest import MAX_TOKENS, rank_pid, session_pids

pytest.importorskip("mlx.core")

MESSAGES = [{"role": "user", "content": "count to ten"}]
GREEDY = {"temperature": 0, "max_tokens": MAX_TOKENS, "extra_body": {"ignore_eos": True}}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def group_server(args: list[str], env: dict[str, str]) -> Iterator[tuple[subprocess.Popen, str]]:
    """`kapitsa serve --hostfile ...` in its own session; killed with its whole session after."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kapitsa", "serve", *args, "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    try:
        while True:
            try:
                httpx.get(url + "/v1/models").raise_for_status()
                break
            except httpx.HTTPError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"the group server did not start: {_stderr(proc)}")
                time.sleep(0.3)
        yield proc, url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _stderr(proc: subprocess.Popen) -> str:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    return proc.stderr.read()[-3000:] if proc.stderr else ""


def single_process_answer(folder: Path) -> str:
    """The same request through kapitsa's own app over a one-process engine (no HTTP socket)."""
    from kapitsa.engine.inprocess import InProcessEngine
    from kapitsa.engine.loading.loader import load_model
    from kapitsa.server.app import create_app

    async def ask(app) -> str:  # noqa: ANN001
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            sdk = openai.AsyncOpenAI(base_url="http://127.0.0.1/v1", api_key="x", http_client=http)
            out = await sdk.chat.completions.create(model=folder.name, messages=MESSAGES, **GREEDY)
            return out.choices[0].message.content

    with contextlib.closing(InProcessEngine.from_loaded(load_model(folder))) as engine:
        return asyncio.run(ask(create_app(engine)))


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)


SERVED = [("nemotron_h", "pipeline", 2), ("qwen3_5_moe", "tensor", 2)]
SERVED_SLOW = [("qwen3_5", "pipeline", 4), ("flint", "tensor", 4)]


def check_served_group(kind: str, parallel: str, ranks: int, checkpoints, hostfiles, group_env) -> None:  # noqa: ANN001
    expected = single_process_answer(checkpoints[kind])
    args = ["--hostfile", str(hostfiles[ranks]), "--parallel", parallel, "-m", str(checkpoints[kind])]
    with group_server(args, group_env) as (proc, url):
        client = sdk(url)
        answer = client.chat.completions.create(model=kind, messages=MESSAGES, **GREEDY)
        assert answer.choices[0].message.content == expected
        assert answer.usage.completion_tokens == MAX_TOKENS
        streamed = client.chat.completions.create(model=kind, messages=MESSAGES, stream=True, **GREEDY)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected
        assert_killed_rank_ends_stream_and_group(client, kind, proc.pid, ranks)
        assert proc.wait(30) != 0, "a group that lost a rank exited 0"


@pytest.mark.parametrize(("kind", "parallel", "ranks"), SERVED)
def test_openai_sdk_gets_the_single_process_answer_then_a_killed_rank_stops_the_group(
    kind: str, parallel: str, ranks: int, checkpoints, hostfiles, group_env
) -> None:
    check_served_group(kind, parallel, ranks, checkpoints, hostfiles, group_env)


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "parallel", "ranks"), SERVED_SLOW)
def test_four_served_ranks(kind: str, parallel: str, ranks: int, checkpoints, hostfiles, group_env) -> None:
    check_served_group(kind, parallel, ranks, checkpoints, hostfiles, group_env)


def assert_killed_rank_ends_stream_and_group(
    client: openai.OpenAI, model: str, session: int, ranks: int
) -> None:
    long = {"temperature": 0, "max_tokens": 100_000, "extra_body": {"ignore_eos": True}}
    other = client.chat.completions.create(model=model, messages=MESSAGES, stream=True, **long)
    stream = client.chat.completions.create(model=model, messages=MESSAGES, stream=True, **long)
    victim = rank_pid(session, ranks - 1)
    assert victim is not None and len(session_pids(session)) >= ranks + 1
    received = 0
    with pytest.raises((openai.APIError, httpx.HTTPError)) as failure:
        for _chunk in stream:
            received += 1
            if received == 3:
                os.kill(victim, signal.SIGKILL)
                killed_at = time.monotonic()
    assert received >= 3
    assert isinstance(failure.value, openai.APIError) and "a rank of the group stopped" in str(failure.value)
    last = None  # a row of the same batch: it ends with the same error
    with pytest.raises(openai.APIError, match="a rank of the group stopped"):
        for last in other:  # noqa: B007 - the last chunk tells how the stream ended when it did not fail
            pass
        pytest.fail(f"the other stream ended without the group's error; its last chunk: {last}")
    while session_pids(session) and time.monotonic() - killed_at < 30:  # a loaded 2-core CI machine
        time.sleep(0.1)
    assert session_pids(session) == [], "ranks still running 30 s after one was killed"
