"""`kapitsa serve`: settings precedence, refusals, and a real tiny checkpoint served end to end."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from kapitsa.commands.serve import cmd_serve, make_settings
from kapitsa.errors import KapitsaError
from kapitsa.server.runner import bound_port, reserve_port, serve_forever
from kapitsa.server.settings import DEFAULT_PORT


def test_flags_override_environment_which_overrides_defaults(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KAPITSA_CONFIG", str(tmp_path / "none.toml"))
    assert make_settings(model=None, host=None, port=None, speculative="none").port == DEFAULT_PORT == 8484
    monkeypatch.setenv("KAPITSA_PORT", "9001")
    monkeypatch.setenv("KAPITSA_HOST", "::1")
    settings = make_settings(model="27b", host=None, port=None, speculative="none")
    assert (settings.port, settings.host, settings.model) == (9001, "::1", "27b")
    assert make_settings(model=None, host="127.0.0.1", port=9002, speculative="none").port == 9002


def test_the_reasoning_budget_comes_from_the_flag_or_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KAPITSA_CONFIG", str(tmp_path / "none.toml"))
    assert make_settings(model=None, host=None, port=None, speculative=None).reasoning_budget is None
    monkeypatch.setenv("KAPITSA_REASONING_BUDGET", "2048")
    assert make_settings(model=None, host=None, port=None, speculative=None).reasoning_budget == 2048
    flagged = make_settings(model=None, host=None, port=None, speculative=None, reasoning_budget=512)
    assert flagged.reasoning_budget == 512
    with pytest.raises(KapitsaError, match="reasoning-budget"):
        make_settings(model=None, host=None, port=None, speculative=None, reasoning_budget=0)


def test_config_file_port_is_used(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text("port = 9100\n")
    monkeypatch.setenv("KAPITSA_CONFIG", str(tmp_path / "config.toml"))
    monkeypatch.delenv("KAPITSA_PORT", raising=False)
    assert make_settings(model=None, host=None, port=None, speculative="none").port == 9100


def test_refuses_network_bind_without_token_before_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KAPITSA_API_KEY", raising=False)
    with pytest.raises(KapitsaError, match="without a token"):
        cmd_serve(model="/nonexistent", host="0.0.0.0", port=None, speculative="none")


@pytest.mark.parametrize(
    ("mode", "message"), [("draft", "needs --draft"), ("block", "needs --draft"), ("warp", "unknown")]
)
def test_speculative_modes_serve_cannot_set_up_are_refused_before_loading(mode: str, message: str) -> None:
    with pytest.raises(KapitsaError, match=message):
        cmd_serve(model="/nonexistent", host=None, port=None, speculative=mode)


def test_cli_prints_the_refusal_and_exits_1() -> None:
    env = {k: v for k, v in os.environ.items() if k != "KAPITSA_API_KEY"}
    done = subprocess.run(
        [sys.executable, "-m", "kapitsa", "serve", "--host", "0.0.0.0", "--model", "x"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 1 and "without a token" in done.stderr


def _served_port(proc: subprocess.Popen[str]) -> int:
    """The port `kapitsa serve --port 0` reports once it serves (it prints the address it bound)."""
    assert proc.stderr is not None
    for line in proc.stderr:
        if line.startswith("kapitsa serving "):
            return int(line.rsplit(":", 1)[1])
    pytest.fail(f"kapitsa serve exited with {proc.wait()} before serving")


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[subprocess.Popen[str], str, str]]:
    tiny = pytest.importorskip("kapitsa.testing.tiny")
    folder = tiny.write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", "qwen3_5")
    state = tmp_path_factory.mktemp("state")
    env = {
        **os.environ,
        "KAPITSA_CACHE_DIR": str(tmp_path_factory.mktemp("cache")),
        "KAPITSA_STATE_DIR": str(state),
    }
    # port 0: the server binds a free port itself, so no other test can take it first
    proc = subprocess.Popen(
        [sys.executable, "-m", "kapitsa", "serve", "--model", str(folder), "--port", "0"],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    port = _served_port(proc)
    assert json.loads((state / "server.json").read_text())["port"] == port  # what `kapitsa env` reads
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        try:
            model_id = httpx.get(url + "/v1/models").json()["data"][0]["id"]
            break
        except httpx.HTTPError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"kapitsa serve did not start: {proc.stderr.read() if proc.stderr else ''}")
            time.sleep(0.2)
    yield proc, url, model_id
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_tiny_checkpoint_through_all_three_apis(tiny_server: tuple[subprocess.Popen[str], str, str]) -> None:
    _, url, model_id = tiny_server
    oai = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    out = oai.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "hi"}], max_tokens=6
    )
    assert out.choices[0].finish_reason in ("stop", "length") and out.usage.completion_tokens >= 1
    chunks = list(
        oai.chat.completions.create(
            model=model_id,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].usage.completion_tokens >= 1
    events = [
        e.type for e in oai.responses.create(model=model_id, input="hi", max_output_tokens=6, stream=True)
    ]
    assert events[0] == "response.created" and events[-1] in ("response.completed", "response.incomplete")
    claude = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=60)
    with claude.messages.stream(
        model="claude-any", max_tokens=6, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason in ("end_turn", "max_tokens") and final.usage.output_tokens >= 1
    count = claude.messages.count_tokens(model=model_id, messages=[{"role": "user", "content": "hi"}])
    assert count.input_tokens > 0
    assert httpx.get(url + "/health").json()["status"] == "ok"


def test_sigterm_drains_the_open_stream_then_exits_0(
    tiny_server: tuple[subprocess.Popen[str], str, str],
) -> None:
    proc, url, model_id = tiny_server
    body = {
        "model": model_id,
        "stream": True,
        "max_tokens": 60,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "count"}],
    }
    lines: list[str] = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as response:
        iterator = response.iter_lines()
        lines.append(next(iterator))
        threading.Timer(0.05, proc.send_signal, args=(signal.SIGTERM,)).start()
        lines.extend(iterator)
    assert lines[-2:] == ["data: [DONE]", ""] or "data: [DONE]" in lines
    rc = proc.wait(timeout=30)
    stderr = proc.stderr.read() if proc.stderr else ""
    if rc == -signal.SIGABRT and "terminate called without an active exception" in stderr:
        # Known engine/MLX teardown abort after the drain (`kapitsa run` shows it too); not a server bug.
        pytest.xfail("MLX thread teardown abort at interpreter exit (engine issue, also in `kapitsa run`)")
    assert rc == 0, stderr
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health")


def test_a_taken_port_fails_before_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(KapitsaError, match=f"cannot listen on 127.0.0.1:{port}"):
            cmd_serve(model="/nonexistent", host="127.0.0.1", port=port, speculative="none")


def test_port_0_binds_a_free_port_before_loading_and_keeps_it() -> None:
    with reserve_port("127.0.0.1", 0) as sock:
        port = bound_port(sock)
        assert port > 0
        with socket.socket() as other, pytest.raises(OSError):  # held while the model loads
            other.bind(("127.0.0.1", port))


def test_a_port_another_server_listens_on_first_is_a_clear_error() -> None:
    from kapitsa.engine.types import ModelInfo
    from kapitsa.server.settings import ServerSettings
    from kapitsa.testing.fake_engine import FakeEngine

    with reserve_port("127.0.0.1", 0) as ours:
        port = bound_port(ours)
        with reserve_port("127.0.0.1", port) as theirs:  # both bound it while loading; theirs serves first
            theirs.listen()
            engine = FakeEngine(model=ModelInfo("m", "fake", 4096, 1024))
            with pytest.raises(
                KapitsaError, match=f"cannot listen on 127.0.0.1:{port} .*while the model loaded"
            ):
                serve_forever(engine, ServerSettings(port=port), ours)


def test_serve_opens_an_engine_that_warms_its_batch_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Concurrent agents form decode batches: the server's engine readies them while idle."""
    import kapitsa.opener

    seen: dict = {}

    class Opened(Exception):
        pass

    def fake_open(ref, **kwargs):
        seen.update(kwargs)
        raise Opened

    monkeypatch.setattr(kapitsa.opener, "open_engine", fake_open)
    with pytest.raises(Opened):
        cmd_serve(model="/any", host="127.0.0.1", port=0, speculative="none")
    assert seen["warm_batches"] is True
