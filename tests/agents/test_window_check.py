"""Before launching, a model whose window cannot hold the agent's first request is refused in one line,
with a catalog model that can; a window that holds it launches as before."""

from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import pytest
from typer.testing import CliRunner

from kapitsa.agents import launch
from kapitsa.agents.window import AGENT_NEEDS, WindowTooSmall, suggest_model, window_shortfall
from kapitsa.catalog import load_catalog
from kapitsa.cli import app

GIB = 2**30
CAPTURES = Path(__file__).resolve().parents[3] / "shared" / "docs" / "agent-captures"


def test_shortfall_names_the_agent_and_both_sizes() -> None:
    message = window_shortfall("claude", "demo", 8192)
    assert (
        message
        == "Claude Code's first request is about 28,000 tokens, but demo's context window is 8,192 tokens"
    )
    assert window_shortfall("pi", "demo", 8192) is None  # pi's first request is small
    assert window_shortfall("codex", "4b", 262144) is None


def test_every_agent_has_a_need_with_room_to_answer() -> None:
    assert set(AGENT_NEEDS) == set(launch.AGENTS)
    for need in AGENT_NEEDS.values():
        assert need.context_tokens > need.first_request_tokens > 1000


def test_the_suggestion_fits_the_machine_and_the_agent() -> None:
    catalog = load_catalog({})
    assert suggest_model(catalog, "claude", exclude="demo", usable_bytes=16 * GIB, num_checkpoints=4) == "9b"
    assert suggest_model(catalog, "claude", exclude="9b", usable_bytes=16 * GIB, num_checkpoints=4) != "9b"
    assert suggest_model(catalog, "claude", exclude="demo", usable_bytes=2 * GIB, num_checkpoints=4) is None
    smallest = suggest_model(catalog, "claude", exclude="demo", usable_bytes=None, num_checkpoints=4)
    assert (
        smallest
        == min(
            (e for e in catalog if e.arch and e.arch.context_length >= 32096), key=lambda e: e.arch.params_b
        ).alias
    )


@pytest.mark.parametrize("agent", ["claude", "codex", "opencode"])
def test_a_small_window_is_refused_before_any_server_starts(
    checkpoint_with_window, agent: str, fake_server, agent_env, settings_for, tmp_path: Path
) -> None:
    small = checkpoint_with_window(tmp_path / "small", 8192)
    with pytest.raises(WindowTooSmall) as err:
        launch.prepare_launch(
            agent,
            str(small),
            [],
            settings=settings_for(fake_server.port),
            api_key=None,
            environ=agent_env,
            usable_bytes=16 * GIB,
        )
    message = str(err.value)
    assert "\n" not in message and "context window is 8,192 tokens" in message
    assert message.endswith(f"; try `kapitsa {agent} --model 9b`")
    assert fake_server.requests == []  # no server was probed, none started


def test_pi_still_launches_on_a_small_window(
    checkpoint_with_window, fake_server, agent_env, settings_for, tmp_path: Path
) -> None:
    small = checkpoint_with_window(tmp_path / "small", 8192)
    fake_server.model_ids = ["small"]
    plan = launch.prepare_launch(
        "pi", str(small), [], settings=settings_for(fake_server.port), api_key=None, environ=agent_env
    )
    assert plan.context.context_window == 8192


def test_cli_says_it_in_one_line_and_does_not_exec(
    checkpoint_with_window, fake_server, agent_env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    small = checkpoint_with_window(tmp_path / "small", 8192)
    for key, value in agent_env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("KAPITSA_PORT", str(fake_server.port))
    monkeypatch.setenv("KAPITSA_STATE_DIR", str(tmp_path / "state"))
    with mock.patch("kapitsa.agents.launch.exec_agent", autospec=True) as exec_:
        result = CliRunner().invoke(app, ["claude", "--model", str(small)])
    assert isinstance(result.exception, WindowTooSmall) and not exec_.called
    message = str(result.exception)  # kapitsa's entry point prints it and exits 1
    assert "\n" not in message and message.startswith("Claude Code's first request is about 28,000 tokens")


@pytest.mark.skipif(not CAPTURES.is_dir(), reason="the full agent captures are in the shared folder only")
def test_the_table_holds_every_captured_first_request() -> None:
    """Each figure is at least the largest capture rendered by the server and counted by the demo's tokenizer,
    and not far above it."""
    measured = _measured_first_requests()
    for agent, need in AGENT_NEEDS.items():
        assert measured[agent] <= need.first_request_tokens < 1.5 * measured[agent], agent


def _measured_first_requests() -> dict[str, int]:
    from fastapi.testclient import TestClient

    from kapitsa.engine.text.tokenizer import Tokenizer
    from kapitsa.server.app import create_app
    from kapitsa.server.settings import ServerSettings
    from kapitsa.testing.fake_engine import FakeEngine
    from tests.checkpoints.conftest import DEMO

    tokenizer = Tokenizer.from_folder(DEMO)
    engine = FakeEngine()
    client = TestClient(create_app(engine, ServerSettings()), base_url="http://127.0.0.1:8484")
    measured: dict[str, int] = {}
    for path in sorted(CAPTURES.glob("*.POST_*.json")):
        record = json.loads(path.read_text())
        client.post(record["path"], json={**record["body"], "model": "fake", "stream": False})
        request = engine.requests[-1]
        text = tokenizer.apply_chat_template(
            list(request.messages or ()),
            list(request.tools or ()) or None,
            True,
            **dict(request.chat_template_kwargs),
        )
        agent = path.name.removeprefix("chatty-sniff-").split("-")[0]
        measured[agent] = max(measured.get(agent, 0), len(tokenizer.encode(text)))
    return measured
