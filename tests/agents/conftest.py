"""Fake agents on PATH that record argv and environment, and a fake kapitsa server."""

from __future__ import annotations

import json
import os
import stat
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kapitsa.settings import load_settings

FAKE_AGENT = r"""#!{python}
import json, os, re, sys, urllib.request
record = os.environ.get("FAKE_AGENT_RECORD")
args = sys.argv[1:]
name = os.path.basename(sys.argv[0])
if args == ["--version"]:
    print("codex-cli 0.171.0" if name == "codex" else "1.0.0")
    sys.exit(0)
if name == "codex" and args and args[0] == "exec":
    # Like Codex: send one Responses request whose first developer message holds the base instructions.
    url = next(a.split("=", 1)[1] for a in args if a.startswith("model_providers.kapitsa.base_url="))
    body = {{"model": "x", "input": [{{"type": "message", "role": "developer",
             "content": [{{"type": "input_text", "text": os.environ.get("FAKE_CODEX_PROMPT", "FAKE CODEX INSTRUCTIONS")}}]}}]}}
    if os.environ.get("FAKE_CODEX_PROMPT") != "none":
        req = urllib.request.Request(json.loads(url) + "/responses", data=json.dumps(body).encode(),
                                     headers={{"Content-Type": "application/json"}})
        urllib.request.urlopen(req, timeout=10).read()
    sys.exit(0)
if record:
    with open(record, "w") as fh:
        json.dump({{"name": name, "argv": args, "env": dict(os.environ)}}, fh)
"""


def write_fake_agents(folder: Path, names: tuple[str, ...] = ("claude", "codex", "opencode", "pi")) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        path = folder / name
        path.write_text(FAKE_AGENT.format(python=sys.executable))
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return folder


@dataclass
class FakeServer:
    model_ids: list[str]
    requests: list[str] = field(default_factory=list)

    def start(self) -> int:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                server.requests.append(self.path)
                if self.path == "/health":
                    body = b'{"status": "ok"}'
                elif self.path == "/v1/models":
                    body = json.dumps(
                        {"object": "list", "data": [{"id": m} for m in server.model_ids]}
                    ).encode()
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self.httpd.server_address[1]

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake_server() -> Iterator[FakeServer]:
    server = FakeServer(["27b"])
    server.port = server.start()  # type: ignore[attr-defined]
    yield server
    server.stop()


@pytest.fixture
def agent_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """An environment with only the fake agents on PATH and a private HOME."""
    monkeypatch.setenv("KAPITSA_CONFIG", str(tmp_path / "no-config.toml"))
    home = tmp_path / "home"
    home.mkdir()
    bin_dir = write_fake_agents(tmp_path / "bin")
    return {
        "PATH": f"{bin_dir}{os.pathsep}/usr/bin:/bin",
        "HOME": str(home),
        "FAKE_AGENT_RECORD": str(tmp_path / "record.json"),
        "ANTHROPIC_API_KEY": "sk-real-user-key",
    }


@pytest.fixture
def settings_for(tmp_path: Path):
    def make(port: int):
        return load_settings(port=port, state_dir=tmp_path / "state", server_start_timeout_s=20)

    return make


def _config_only_checkpoint(folder: Path, context: int) -> Path:
    """A config-only checkpoint folder: enough for the launcher to read its window."""
    folder.mkdir()
    config = {
        "model_type": "nemotron_h",
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "hybrid_override_pattern": "M*E",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "ssm_state_size": 16,
        "n_groups": 1,
        "vocab_size": 512,
        "max_position_embeddings": context,
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture
def checkpoint_with_window():
    """`make(folder, context)`: a config-only Nemotron-H checkpoint whose window is `context`."""
    return _config_only_checkpoint
