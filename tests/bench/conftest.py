from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from kapitsa.bench.schema import report_from_dict
from kapitsa.errors import InvalidRequest

sys.path.insert(0, str(Path(__file__).parent))
from tiny_llama import write_tiny_llama  # noqa: E402


@pytest.fixture(autouse=True)
def bench_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Keep every saved report inside the test's temp folder."""
    folder = tmp_path / "bench-results"
    monkeypatch.setenv("KAPITSA_BENCH_DIR", str(folder))
    monkeypatch.delenv("KAPITSA_BENCH_RESULTS_URL", raising=False)
    return folder


class Receiver:
    """A results server on 127.0.0.1 that validates and records what `--submit` posts."""

    def __init__(self) -> None:
        self.received: list[dict] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                try:
                    report_from_dict(body)
                except InvalidRequest as err:
                    return self._reply(400, {"error": str(err)})
                receiver.received.append(body)
                self._reply(201, {"id": f"run-{len(receiver.received)}"})

            def _reply(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/results"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


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
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def mlx_lm_server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
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
            str(tiny_llama_dir),
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


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mlx_lm.server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("mlx_lm.server did not become healthy")
