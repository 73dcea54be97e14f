"""Claude Code, Codex, opencode and pi (real npm packages) against `kapitsa serve` with a scripted engine.

The scripted model answers with a shell tool call that writes a file (each agent in a different tool-call
format), then with a final message; each agent must run the tool, send the result back, and exit 0.
Skipped only when npm cannot install the agents.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from agent_harness import FINAL_TEXT, ScriptedAgentModel, agent_command, agent_version, ensure_agents
from server_harness import live_server

from kapitsa.testing.fake_engine import FakeEngine

FORMATS = {
    "claude": "qwen3_coder",
    "codex": "hermes",
    "opencode": "nemotron",
    "pi": "qwen3_coder",
    "pi-responses": "hermes",
    "pi-anthropic": "nemotron",
}


@pytest.fixture(scope="module")
def bin_dir() -> Path:
    found, why = ensure_agents()
    if found is None:
        pytest.skip(f"real agents unavailable: {why}")
    return found


@pytest.mark.parametrize("agent", list(FORMATS))
def test_agent_runs_a_tool_call_and_finishes(agent: str, bin_dir: Path, tmp_path: Path) -> None:
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    marker = f"KAPITSA_{agent.upper().replace('-', '_')}_OK"
    engine = FakeEngine(responder=ScriptedAgentModel(f"echo {marker} > kapitsa_probe.txt", FORMATS[agent]))
    with live_server(engine) as live:
        argv, env, stdin = agent_command(agent, bin_dir, live.url, home, work)
        started = time.monotonic()
        done = subprocess.run(
            argv, cwd=work, env=env, input=stdin, capture_output=True, text=True, timeout=150
        )
        elapsed = time.monotonic() - started
    report = f"{agent} {agent_version(agent)} rc={done.returncode} in {elapsed:.1f}s\nstdout: {done.stdout[-2000:]}\nstderr: {done.stderr[-2000:]}"
    assert done.returncode == 0, report
    assert (work / "kapitsa_probe.txt").read_text().strip() == marker, report
    assert FINAL_TEXT in done.stdout, report
    assert any(any(m.get("role") == "tool" for m in r.messages or ()) for r in engine.requests), report
