"""Each launcher against fake agent binaries that record argv and environment, and a fake server."""

from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import pytest
from agent_fakes import run_recorded
from typer.testing import CliRunner

from kapitsa.agents import launch
from kapitsa.agents.base import AgentNotInstalled
from kapitsa.cli import app
from kapitsa.errors import KapitsaError


def _plan(agent: str, fake_server, agent_env, settings_for, args=(), model="27b", usable=None):
    return launch.prepare_launch(
        agent,
        model,
        list(args),
        settings=settings_for(fake_server.port),
        api_key=None,
        environ=agent_env,
        usable_bytes=usable,
    )


def test_claude_by_environment_only(fake_server, agent_env, settings_for, tmp_path: Path) -> None:
    plan = _plan("claude", fake_server, agent_env, settings_for, ["-p", "say hi"])
    assert not plan.server.started and plan.server.base_url == f"http://127.0.0.1:{fake_server.port}"
    seen = run_recorded(plan.command, plan.env)
    assert seen["argv"] == ["--model", "27b", "-p", "say hi"]
    env = seen["env"]
    assert env["ANTHROPIC_BASE_URL"] == plan.server.base_url and env["ANTHROPIC_API_KEY"] == ""
    assert env["ANTHROPIC_AUTH_TOKEN"] == "kapitsa"
    for tier in ("OPUS", "SONNET", "HAIKU"):
        assert env[f"ANTHROPIC_DEFAULT_{tier}_MODEL"] == "27b"
    assert env["CLAUDE_CODE_SUBAGENT_MODEL"] == env["ANTHROPIC_MODEL"] == "27b"
    assert env["CLAUDE_CODE_ATTRIBUTION_HEADER"] == "0"
    assert (env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"], env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"]) == (
        "262144",
        "32768",
    )
    assert not (Path(agent_env["HOME"]) / ".claude").exists()


def test_context_window_is_capped_by_memory(fake_server, agent_env, settings_for) -> None:
    plan = _plan("claude", fake_server, agent_env, settings_for, usable=24 * 2**30)
    assert 65536 < plan.context.context_window < 262144
    assert plan.context.max_output <= plan.context.context_window // 2


def test_codex_by_overrides_and_a_catalog_in_kapitsas_folder(fake_server, agent_env, settings_for) -> None:
    plan = _plan("codex", fake_server, agent_env, settings_for, ["exec", "fix it"])
    seen = run_recorded(plan.command, plan.env)
    argv = seen["argv"]
    overrides = [argv[i + 1] for i, a in enumerate(argv) if a == "-c"]
    assert 'model_provider="kapitsa"' in overrides
    assert f'model_providers.kapitsa.base_url="{plan.server.base_url}/v1"' in overrides
    assert 'model_providers.kapitsa.wire_api="responses"' in overrides
    assert 'model_providers.kapitsa.env_key="KAPITSA_API_KEY"' in overrides
    catalog_path = Path(
        json.loads(next(o for o in overrides if o.startswith("model_catalog_json=")).split("=", 1)[1])
    )
    assert catalog_path.parent == plan.context.state_dir / "codex"
    [entry] = json.loads(catalog_path.read_text())["models"]
    assert entry["slug"] == "27b" and entry["context_window"] == 262144
    assert entry["base_instructions"] == "FAKE CODEX INSTRUCTIONS"
    assert argv[-4:] == ["-m", "27b", "exec", "fix it"]
    assert seen["env"]["KAPITSA_API_KEY"] == "kapitsa"
    assert not (Path(agent_env["HOME"]) / ".codex").exists()


def test_codex_without_captured_instructions_passes_the_window(fake_server, agent_env, settings_for) -> None:
    plan = _plan("codex", fake_server, {**agent_env, "FAKE_CODEX_PROMPT": "none"}, settings_for)
    assert "model_context_window=262144" in plan.command
    assert not any(a.startswith("model_catalog_json=") for a in plan.command)


@pytest.mark.parametrize(
    "bad", [["-m", "x"], ["--profile", "p"], ["-c", "model_provider=openai"], ["-c", "model=o3"]]
)
def test_codex_rejects_arguments_that_fight_kapitsa(fake_server, agent_env, settings_for, bad) -> None:
    with pytest.raises(KapitsaError, match="conflicts"):
        _plan("codex", fake_server, agent_env, settings_for, bad)


def test_opencode_by_inline_config(fake_server, agent_env, settings_for) -> None:
    user_inline = json.dumps({"share": "disabled", "provider": {"other": {"npm": "x"}}})
    plan = _plan(
        "opencode",
        fake_server,
        {**agent_env, "OPENCODE_CONFIG_CONTENT": user_inline},
        settings_for,
        ["run", "hello"],
    )
    seen = run_recorded(plan.command, plan.env)
    assert seen["argv"] == ["run", "hello"]
    config = json.loads(seen["env"]["OPENCODE_CONFIG_CONTENT"])
    provider = config["provider"]["kapitsa"]
    assert provider["npm"] == "@ai-sdk/openai-compatible"
    assert provider["options"]["baseURL"] == f"{plan.server.base_url}/v1"
    assert provider["models"]["27b"]["limit"] == {"context": 262144, "output": 32768}
    assert config["model"] == config["small_model"] == "kapitsa/27b"
    assert config["share"] == "disabled" and "other" in config["provider"]  # the user's inline keys stay
    with pytest.raises(KapitsaError, match="not valid JSON"):
        _plan("opencode", fake_server, {**agent_env, "OPENCODE_CONFIG_CONTENT": "{oops"}, settings_for)


def test_pi_by_a_merged_models_file(fake_server, agent_env, settings_for) -> None:
    models = Path(agent_env["HOME"]) / ".pi" / "agent" / "models.json"
    models.parent.mkdir(parents=True)
    original = b'{\n    "providers": {"mine": {"baseUrl": "http://x", "api": "openai-completions", "apiKey": "K",\n      "models": [{"id": "m"}]}},\n    "extra": [1, 2]\n}\n'
    models.write_bytes(original)
    plan = _plan("pi", fake_server, agent_env, settings_for, ["-p", "hi"])
    seen = run_recorded(plan.command, plan.env)
    assert seen["argv"] == ["--provider", "kapitsa", "--model", "27b", "-p", "hi"]
    assert seen["env"]["KAPITSA_API_KEY"] == "kapitsa"
    config = json.loads(models.read_text())
    assert config["providers"]["mine"] == json.loads(original)["providers"]["mine"] and config["extra"] == [
        1,
        2,
    ]
    kapitsa = config["providers"]["kapitsa"]
    assert kapitsa["baseUrl"] == f"{plan.server.base_url}/v1" and kapitsa["api"] == "openai-completions"
    assert kapitsa["models"][0]["contextWindow"] == 262144 and kapitsa["models"][0]["_kapitsa"] is True
    from kapitsa.agents import pi

    assert "byte-for-byte" in pi.restore_config(agent_env, plan.context.state_dir)
    assert models.read_bytes() == original


def test_missing_agent_names_its_install_command(fake_server, settings_for, tmp_path: Path) -> None:
    env = {"PATH": str(tmp_path / "empty"), "HOME": str(tmp_path)}
    with pytest.raises(AgentNotInstalled, match="npm install -g @openai/codex"):
        launch.prepare_launch(
            "codex", "27b", [], settings=settings_for(fake_server.port), api_key=None, environ=env
        )


def test_cli_launch_execs_the_agent(
    checkpoint_with_window, fake_server, agent_env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint = checkpoint_with_window(tmp_path / "my-model", 16384)
    fake_server.model_ids = ["my-model"]
    for key, value in agent_env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("KAPITSA_PORT", str(fake_server.port))
    monkeypatch.setenv("KAPITSA_STATE_DIR", str(tmp_path / "state"))
    with mock.patch(
        "kapitsa.agents.launch.exec_agent", autospec=True, side_effect=RuntimeError("exec")
    ) as exec_:
        result = CliRunner().invoke(app, ["opencode", "--model", str(checkpoint), "--", "run", "x"])
    assert isinstance(result.exception, RuntimeError)
    command, env = exec_.call_args.args
    assert command[1:] == ["run", "x"]
    limits = json.loads(env["OPENCODE_CONFIG_CONTENT"])["provider"]["kapitsa"]["models"]["my-model"]["limit"]
    assert limits["context"] == 16384  # the checkpoint's own window


def test_cli_missing_agent_exits_with_the_install_hint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("KAPITSA_CONFIG", str(tmp_path / "none.toml"))
    result = CliRunner().invoke(app, ["pi", "--model", "27b"])
    assert result.exit_code != 0 and "npm install -g @earendil-works/pi-coding-agent" in str(result.exception)


def test_agent_invocation_for_a_server_someone_else_runs(agent_env, tmp_path: Path, monkeypatch) -> None:
    """The TUI's entry point: argv and env additions for a running server, no server management."""
    monkeypatch.setenv("KAPITSA_STATE_DIR", str(tmp_path / "state"))
    for agent in ("claude", "opencode", "pi", "codex"):
        argv, additions = launch.agent_invocation(
            agent, "http://127.0.0.1:9999", "lightning", ["--x"], environ=agent_env, api_key="tok"
        )
        assert Path(argv[0]).name == agent and argv[-1] == "--x"
        assert "PATH" not in additions  # only what kapitsa adds
    assert additions["KAPITSA_API_KEY"] == "tok"
    from kapitsa.agents import claude, opencode

    env = claude.build_env("http://127.0.0.1:9999", "lightning")  # the style-guide call form
    assert (
        env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:9999"
        and env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "131072"
    )
    assert claude.build_command([]) == ["claude"]
    config = json.loads(
        opencode.build_env("http://127.0.0.1:9999/v1", "lightning", environ={})["OPENCODE_CONFIG_CONTENT"]
    )
    assert config["provider"]["kapitsa"]["options"]["baseURL"] == "http://127.0.0.1:9999/v1"


def test_cli_pi_restore(fake_server, agent_env, tmp_path: Path, monkeypatch) -> None:
    for key, value in agent_env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("KAPITSA_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("KAPITSA_PORT", str(fake_server.port))
    models = Path(agent_env["HOME"]) / ".pi" / "agent" / "models.json"
    checkpoint = tmp_path / "local-model"  # a local folder: nothing to download
    checkpoint.mkdir()
    fake_server.model_ids = ["local-model"]
    with mock.patch(
        "kapitsa.agents.launch.exec_agent", autospec=True, side_effect=RuntimeError("exec")
    ) as exec_:
        CliRunner().invoke(app, ["pi", "--model", str(checkpoint)])
    assert exec_.call_args.args[0][1:] == ["--provider", "kapitsa", "--model", "local-model"]
    assert "kapitsa" in json.loads(models.read_text())["providers"]
    result = CliRunner().invoke(app, ["pi", "--restore"], catch_exceptions=False)
    assert result.exit_code == 0 and "did not exist before kapitsa" in result.stdout
    assert not models.exists()
