"""The real `kapitsa` binary in a real terminal (tmux, 80x24): start the engine on a tiny checkpoint, read the live panels."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from kapitsa.testing import tiny

pytestmark = pytest.mark.skipif(
    shutil.which("tmux") is None, reason="tmux is not installed (apt-get install tmux)"
)

KAPITSA = Path(sys.executable).parent / "kapitsa"


class Tmux:
    """One detached tmux session running a command at a fixed size."""

    def __init__(self, command: list[str], env: dict[str, str], *, size: tuple[int, int] = (80, 24)) -> None:
        self.name = f"kapitsa-test-{uuid.uuid4().hex[:8]}"
        env_args = [item for key, value in env.items() for item in ("-e", f"{key}={value}")]
        subprocess.run(
            [
                "tmux",
                "new-session",
                "-d",
                "-s",
                self.name,
                "-x",
                str(size[0]),
                "-y",
                str(size[1]),
                *env_args,
                *command,
            ],
            check=True,
        )

    def screen(self) -> str:
        out = subprocess.run(["tmux", "capture-pane", "-p", "-t", self.name], capture_output=True, text=True)
        return out.stdout

    def press(self, *keys: str) -> None:
        subprocess.run(["tmux", "send-keys", "-t", self.name, *keys], check=True)

    def alive(self) -> bool:
        return subprocess.run(["tmux", "has-session", "-t", self.name], capture_output=True).returncode == 0

    def wait_for(self, condition: Callable[[str], bool], what: str, timeout_s: float = 60.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = self.screen()
            if condition(text):
                return text
            time.sleep(0.25)
        raise AssertionError(f"timed out waiting for {what}; the screen shows:\n{self.screen()}")

    def kill(self) -> None:
        subprocess.run(["tmux", "kill-session", "-t", self.name], capture_output=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def kapitsa_in_tmux(tmp_path: Path) -> Iterator[tuple[Tmux, int]]:
    checkpoint = tiny.write_tiny_checkpoint(tmp_path / "tiny-qwen", "qwen3_5")
    port = _free_port()
    config = tmp_path / "config.toml"
    config.write_text(f'default_model = "{checkpoint}"\nport = {port}\n')
    env = {
        "KAPITSA_CONFIG": str(config),
        "HF_HUB_CACHE": str(tmp_path / "hf"),
        "HF_HUB_OFFLINE": "1",
        "XDG_STATE_HOME": str(tmp_path / "state"),
        "TERM": "xterm-256color",
        "PATH": os.environ["PATH"],
    }
    session = Tmux([str(KAPITSA)], env)
    try:
        yield session, port
    finally:
        session.kill()


def test_home_then_engine_then_live_panels(kapitsa_in_tmux: tuple[Tmux, int]) -> None:
    tmux, port = kapitsa_in_tmux
    home = tmux.wait_for(
        lambda s: "This machine" in s and "tiny-qwen" in s and "recommended" in s, "the home screen"
    )
    assert "not rated" in home and "Models" in home
    tmux.press("s")
    running = tmux.wait_for(lambda s: "● running" in s, "the engine to start")
    assert f"http://127.0.0.1:{port}/v1" in running and "OPENAI_BASE_URL" in running
    body = {"model": "tiny-qwen", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 12}
    reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    tmux.press("2")
    live = tmux.wait_for(lambda s: _done(s) >= 1, "the live panels to show the finished request")
    assert "tok/s" in live and "prompt tokens computed" in live and "hit rate" in live
    tmux.press("q")
    deadline = time.monotonic() + 30
    while tmux.alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not tmux.alive(), "kapitsa did not exit on q"


def _done(screen: str) -> int:
    for line in screen.splitlines():
        if "done" in line:
            tail = line.split("done", 1)[1].split()
            if tail and tail[0].isdigit():
                return int(tail[0])
    return 0
