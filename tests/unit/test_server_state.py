"""`kapitsa env` prints the port the running server really got (the TUI moves on when 8484 is taken)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kapitsa.commands.env import cmd_env
from kapitsa.server_state import STATE_FILE, forget_server, record_server, running_server


@pytest.fixture
def state_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KAPITSA_CONFIG", str(tmp_path / "missing.toml"))
    monkeypatch.setenv("KAPITSA_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("KAPITSA_API_KEY", "")
    monkeypatch.delenv("KAPITSA_PORT", raising=False)
    monkeypatch.setattr("kapitsa.token.get_token", _no_token)
    return tmp_path / "state"


def _no_token(_state_dir):
    from types import SimpleNamespace

    return SimpleNamespace(token=None, warning=None)


def test_env_prints_the_running_servers_port(state_dir, capsys) -> None:
    record_server(state_dir, host="127.0.0.1", port=8485)
    cmd_env("bash")
    out = capsys.readouterr().out
    assert "http://127.0.0.1:8485/v1" in out and "8484" not in out


def test_env_falls_back_to_the_configured_port_when_the_server_is_gone(state_dir, capsys) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    state_dir.mkdir(parents=True)
    (state_dir / STATE_FILE).write_text(
        json.dumps({"host": "127.0.0.1", "port": 8485, "pid": int(dead.stdout)})
    )
    assert running_server(state_dir) is None
    cmd_env("bash")
    assert "http://127.0.0.1:8484/v1" in capsys.readouterr().out


def test_record_is_private_and_forgotten_on_stop(state_dir) -> None:
    record_server(state_dir, host="127.0.0.1", port=9000)
    assert (state_dir / STATE_FILE).stat().st_mode & 0o077 == 0
    assert running_server(state_dir).port == 9000
    forget_server(state_dir)
    assert not (state_dir / STATE_FILE).exists()


def test_an_ipv6_server_gets_a_bracketed_url(state_dir) -> None:
    assert record_server(state_dir, host="::1", port=8485).url == "http://[::1]:8485"
    assert record_server(state_dir, host="127.0.0.1", port=8485).url == "http://127.0.0.1:8485"
