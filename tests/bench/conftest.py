from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kapitsa.testing import tiny

sys.path.insert(0, str(Path(__file__).parent))
from results_receiver import Receiver  # noqa: E402


@pytest.fixture(autouse=True)
def bench_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Keep every saved report inside the test's temp folder."""
    folder = tmp_path / "bench-results"
    monkeypatch.setenv("KAPITSA_BENCH_DIR", str(folder))
    monkeypatch.delenv("KAPITSA_BENCH_RESULTS_URL", raising=False)
    return folder


@pytest.fixture(autouse=True)
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The local engine's prefix-cache disk tier goes to the test's temp folder, not the user's state."""
    folder = tmp_path / "state"
    monkeypatch.setenv("KAPITSA_STATE_DIR", str(folder))
    return folder


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def tiny_qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """kapitsa's tiny random Qwen3.5 checkpoint, which mlx-lm loads too (so both engines can serve it)."""
    return tiny.write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny-qwen3_5", "qwen3_5")


@pytest.fixture(scope="session")
def mlx_lm_server(tiny_qwen_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real `mlx_lm.server` serving the tiny checkpoint; yields its base URL."""
    port = free_port()
    env = {
        **os.environ,
        "HF_HOME": str(tmp_path_factory.mktemp("hf-home")),
    }  # an empty cache: one model listed
    log = (tmp_path_factory.mktemp("mlx-server") / "server.log").open("w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlx_lm.server",
            "--model",
            str(tiny_qwen_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 90.0, path: str = "/health") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[2:4]} exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}{path}", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{proc.args[2:4]} did not become healthy")


@pytest.fixture(scope="session")
def kapitsa_server(tiny_qwen_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A second `kapitsa serve` on loopback serving the tiny checkpoint; yields its base URL."""
    port = free_port()
    env = {
        **os.environ,
        "KAPITSA_CACHE_DIR": str(tmp_path_factory.mktemp("kapitsa-cache")),
        "KAPITSA_STATE_DIR": str(tmp_path_factory.mktemp("kapitsa-state")),
    }
    log = (tmp_path_factory.mktemp("kapitsa-serve") / "server.log").open("w")
    command = [sys.executable, "-m", "kapitsa", "serve", "--model", str(tiny_qwen_dir), "--port", str(port)]
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc, path="/v1/models")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()
