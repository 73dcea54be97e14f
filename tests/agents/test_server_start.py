"""Reusing a running server for the model, or starting `kapitsa serve` in the background."""

from __future__ import annotations

import os
import signal
import stat
import sys
from pathlib import Path

import pytest

from kapitsa.agents import server as server_mod
from kapitsa.errors import KapitsaError

FAKE_SERVE = r"""
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
model, port = sys.argv[1], int(sys.argv[2])
if model == "crash":
    print("loading crash... no such weights", flush=True)
    sys.exit(3)
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def do_GET(self):
        body = b'{"status":"ok"}' if self.path == "/health" else json.dumps({"data": [{"id": model}]}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers(); self.wfile.write(body)
print("serving", model, flush=True)
HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


@pytest.fixture
def fake_serve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    script = tmp_path / "fake_serve.py"
    script.write_text(FAKE_SERVE)
    seen: list[list[str]] = []

    def command(model_ref: str, host: str, port: int, serve_args: tuple[str, ...] = ()) -> list[str]:
        seen.append([model_ref, host, str(port), *serve_args])
        return [sys.executable, str(script), model_ref, str(port)]

    monkeypatch.setattr(server_mod, "serve_command", command)
    return seen


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_starts_a_detached_server_and_waits_for_health(fake_serve, tmp_path: Path) -> None:
    port = _free_port()
    handle = server_mod.ensure_server(
        model_ref="27b",
        wanted_ids=("27b",),
        host="127.0.0.1",
        first_port=port,
        api_key="tok",
        log_dir=tmp_path / "logs",
        timeout_s=20,
        serve_args=("--speculative", "ngram"),
    )
    try:
        assert handle.started and handle.model_id == "27b" and handle.base_url.endswith(f":{port}")
        assert fake_serve == [["27b", "127.0.0.1", str(port), "--speculative", "ngram"]]
        assert os.getsid(handle.pid) == handle.pid  # its own session: it outlives the launcher
        assert "serving 27b" in handle.log_path.read_text()  # type: ignore[union-attr]
        assert stat.S_IMODE(handle.log_path.stat().st_mode) == 0o600  # type: ignore[union-attr]
        assert stat.S_IMODE((tmp_path / "logs").stat().st_mode) == 0o700
        again = server_mod.ensure_server(
            model_ref="27b",
            wanted_ids=("27b",),
            host="127.0.0.1",
            first_port=port,
            api_key="tok",
            log_dir=tmp_path / "logs",
            timeout_s=20,
        )
        assert not again.started and again.base_url == handle.base_url and len(fake_serve) == 1
    finally:
        os.kill(handle.pid, signal.SIGTERM)  # type: ignore[arg-type]


def test_a_server_for_another_model_is_skipped(fake_serve, tmp_path: Path) -> None:
    port = _free_port()
    other = server_mod.ensure_server(
        model_ref="other",
        wanted_ids=("other",),
        host="127.0.0.1",
        first_port=port,
        api_key=None,
        log_dir=tmp_path,
        timeout_s=20,
    )
    mine = None
    try:
        mine = server_mod.ensure_server(
            model_ref="27b",
            wanted_ids=("27b",),
            host="127.0.0.1",
            first_port=port,
            api_key=None,
            log_dir=tmp_path,
            timeout_s=20,
        )
        assert mine.started and mine.base_url != other.base_url and mine.model_id == "27b"
    finally:
        for handle in (other, mine):
            if handle is not None:
                os.kill(handle.pid, signal.SIGTERM)  # type: ignore[arg-type]


def test_a_server_that_dies_reports_its_log(fake_serve, tmp_path: Path) -> None:
    with pytest.raises(KapitsaError, match="no such weights"):
        server_mod.ensure_server(
            model_ref="crash",
            wanted_ids=("crash",),
            host="127.0.0.1",
            first_port=_free_port(),
            api_key=None,
            log_dir=tmp_path,
            timeout_s=20,
        )


def test_real_serve_command_runs_kapitsa_serve() -> None:
    cmd = server_mod.serve_command("27b", "127.0.0.1", 8484, ("--speculative", "mtp"))
    assert cmd[1:] == [
        "-m",
        "kapitsa",
        "serve",
        "--model",
        "27b",
        "--host",
        "127.0.0.1",
        "--port",
        "8484",
        "--speculative",
        "mtp",
    ]
