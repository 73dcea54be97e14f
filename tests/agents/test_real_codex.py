"""With the real Codex CLI (if installed): it accepts kapitsa's catalog, sends its own base instructions,
and prints no "model metadata not found" warning. Slow: Codex starts a sandbox and a session."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kapitsa.agents import launch
from kapitsa.agents.codex import _minimal_response_stream
from kapitsa.settings import load_settings

pytestmark = pytest.mark.slow
CODEX = os.environ.get("KAPITSA_TEST_CODEX") or shutil.which("codex")


@pytest.mark.skipif(CODEX is None, reason="codex is not installed (npm install -g @openai/codex)")
def test_real_codex_takes_the_catalog(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bodies: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            body = b'{"status":"ok"}' if self.path == "/health" else b'{"data":[{"id":"27b"}]}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            body = _minimal_response_stream()
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    monkeypatch.setenv("KAPITSA_CONFIG", str(tmp_path / "none.toml"))
    home = tmp_path / "home"
    home.mkdir()
    env = {
        **os.environ,
        "HOME": str(home),
        "CODEX_HOME": str(home / ".codex"),
        "PATH": f"{Path(CODEX).parent}{os.pathsep}{os.environ['PATH']}",
    }  # type: ignore[arg-type]
    (home / ".codex").mkdir()
    settings = load_settings(port=httpd.server_address[1], state_dir=tmp_path / "state")
    try:
        plan = launch.prepare_launch(
            "codex",
            "27b",
            ["exec", "--skip-git-repo-check", "--ephemeral", "say hi"],
            settings=settings,
            api_key=None,
            environ=env,
        )
        run = subprocess.run(
            plan.command,
            env=plan.env,
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=120,
            cwd=tmp_path,
        )
    finally:
        httpd.shutdown()
    assert run.returncode == 0, run.stderr
    assert "metadata" not in run.stderr.lower()
    first = bodies[-1]["input"][0]["content"][0]["text"]
    assert first.startswith("You are") and len(first) > 1000
