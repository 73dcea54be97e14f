"""The TUI's adapter over the real pieces: the server it starts, env lines, and the agent launch plan."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import httpx
import pytest
from tui_support import FakeServices

from kapitsa.engine.types import ModelInfo
from kapitsa.testing.fake_engine import FakeEngine
from kapitsa.tui.services import TuiServices, Unavailable, needs


@pytest.fixture
def running(tmp_path: Path):
    services = FakeServices(
        tmp_path, engine_factory=lambda ref: FakeEngine(model=ModelInfo(ref, "fake", 32768, 8192))
    )
    handle = services.start_engine("4b")
    yield services, handle
    handle.stop()


def test_the_server_listens_on_loopback_and_stops(running) -> None:
    _, handle = running
    assert handle.url.startswith("http://127.0.0.1:")
    assert httpx.get(f"{handle.url}/v1/models").json()["data"][0]["id"] == "4b"
    handle.stop()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{handle.url}/health", timeout=2)
    handle.stop()  # twice is harmless


def test_a_taken_port_moves_the_server_to_the_next_one(tmp_path) -> None:
    services = FakeServices(
        tmp_path, engine_factory=lambda ref: FakeEngine(model=ModelInfo(ref, "fake", 32768, 8192))
    )
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        services.settings.port = taken.getsockname()[1]
        handle = services.start_engine("4b")
        try:
            port = int(handle.url.rsplit(":", 1)[1])
            assert port != services.settings.port
            assert httpx.get(f"{handle.url}/health").json()["status"] == "ok"
        finally:
            handle.stop()


def test_env_lines_point_at_the_server(running) -> None:
    services, handle = running
    text = "\n".join(TuiServices.env_lines(services, handle))
    assert f"OPENAI_BASE_URL='{handle.url}/v1'" in text and f"ANTHROPIC_BASE_URL='{handle.url}'" in text


def test_claude_is_launched_against_the_running_server(running, tmp_path: Path, monkeypatch) -> None:
    """Check that the launch plan reuses the TUI's server (no second server) and sets Claude Code's env."""
    services, handle = running
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_claude = bin_dir / "claude"
    fake_claude.write_text('#!/bin/sh\n[ "$ANTHROPIC_BASE_URL" = "$1" ] && exit 7\nexit 1\n')
    fake_claude.chmod(fake_claude.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    argv, env = TuiServices.agent_invocation(services, "claude", handle)
    assert argv == [str(fake_claude), "--model", "4b"]
    assert env["ANTHROPIC_BASE_URL"] == handle.url and env["ANTHROPIC_MODEL"] == "4b"
    assert TuiServices.run_agent(services, [str(fake_claude), handle.url], env) == 7


def test_missing_pieces_say_what_is_missing() -> None:
    missing = pytest.raises(Unavailable, match="the in-process engine is not available in this build")
    with missing, needs("the in-process engine"):
        import kapitsa.engine.not_a_module  # noqa: F401


def test_the_started_server_is_recorded_for_kapitsa_env(running) -> None:
    from kapitsa.server_state import running_server

    services, handle = running
    record = running_server(services.settings.state_dir)
    assert record is not None and record.url == handle.url
    handle.stop()
    assert running_server(services.settings.state_dir) is None
