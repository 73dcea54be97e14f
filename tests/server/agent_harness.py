"""Real coding agents from npm, driven non-interactively against a live kapitsa server (see real-agents.md)."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kapitsa.engine.types import GenerationRequest

PACKAGES = {
    "claude": "@anthropic-ai/claude-code",
    "codex": "@openai/codex",
    "opencode": "opencode-ai",
    "pi": "@mariozechner/pi-coding-agent",
}
SHELL_TOOLS = ("Bash", "bash", "exec_command", "shell")
PROMPT = "Write the probe file with your shell tool, then say done."
FINAL_TEXT = "All done: the probe file is written."


def agents_dir() -> Path:
    return Path(os.environ.get("KAPITSA_TEST_AGENTS_DIR", Path.home() / ".cache" / "kapitsa" / "test-agents"))


def ensure_agents() -> tuple[Path | None, str]:
    """The folder of agent binaries (installing them once), or None and why not."""
    root = agents_dir()
    root.mkdir(parents=True, exist_ok=True)
    # Test workers run in parallel: one installs while the others wait, then find the binaries.
    with (root / ".install.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _install_agents(root)


def _install_agents(root: Path) -> tuple[Path | None, str]:
    bin_dir = root / "node_modules" / ".bin"
    if all((bin_dir / name).exists() for name in PACKAGES):
        return bin_dir, ""
    npm = shutil.which("npm")
    if npm is None:
        return None, "npm is not installed"
    try:
        done = subprocess.run(
            [npm, "install", "--prefix", str(root), "--no-audit", "--no-fund", *PACKAGES.values()],
            capture_output=True,
            text=True,
            timeout=600,
        )
    except subprocess.TimeoutExpired:
        return None, "npm install timed out (registry unreachable?)"
    if done.returncode != 0:
        return None, f"npm install failed (registry unreachable?): {done.stderr.strip()[-300:]}"
    return bin_dir, ""


def agent_version(name: str) -> str:
    package = agents_dir() / "node_modules" / PACKAGES[name.split("-")[0]] / "package.json"
    return str(json.loads(package.read_text())["version"])


# ---- the scripted model --------------------------------------------------------------------------------


def _call_arguments(schema: dict[str, Any], command: str) -> dict[str, Any]:
    props = schema.get("properties", {})
    key = "cmd" if "cmd" in props else "command"
    args: dict[str, Any] = {key: command}
    for name in schema.get("required", []):
        if name not in args and props.get(name, {}).get("type") == "string":
            args[name] = "write the probe file"
    if "description" in props:
        args["description"] = "write the probe file"
    return args


def tool_call_text(fmt: str, name: str, args: dict[str, Any]) -> str:
    """A tool call written the way a model of format `fmt` writes it."""
    if fmt == "hermes":
        return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"
    if fmt == "nemotron":
        return "<TOOLCALL>" + json.dumps([{"name": name, "arguments": args}]) + "</TOOLCALL>"
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


@dataclass
class ScriptedAgentModel:
    """Answers the first turn that offers a shell tool with a call writing `file`, then a final message."""

    command: str
    fmt: str = "qwen3_coder"

    def __call__(self, request: GenerationRequest) -> str:
        messages = request.messages or ()
        if any(m.get("role") == "tool" for m in messages):
            return FINAL_TEXT
        tools = {t["function"]["name"]: t["function"].get("parameters") or {} for t in request.tools or ()}
        shell = next((n for n in SHELL_TOOLS if n in tools), None)
        if shell is None:
            return "Probe title"  # opencode's concurrent title request, and any side query
        return "<think>The user wants the probe file.</think>\n\nWriting it now.\n" + tool_call_text(
            self.fmt, shell, _call_arguments(tools[shell], self.command)
        )


# ---- drive commands ------------------------------------------------------------------------------------


def agent_command(
    name: str, bin_dir: Path, base_url: str, home: Path, cwd: Path
) -> tuple[list[str], dict[str, str], str | None]:
    """argv, environment and stdin for one non-interactive run of agent `name` in `cwd`."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("ANTHROPIC_", "OPENAI_", "CLAUDE_", "CODEX_", "OPENCODE_", "PI_"))
    }
    # opencode takes its project folder from $PWD, not from the process's working directory.
    env.update(HOME=str(home), PWD=str(cwd), PATH=f"{bin_dir}:{env.get('PATH', '')}", NO_COLOR="1")
    if name == "claude":
        env.update(
            CLAUDE_CONFIG_DIR=str(home / ".claude"),
            ANTHROPIC_BASE_URL=base_url,
            ANTHROPIC_AUTH_TOKEN="x",
            ANTHROPIC_API_KEY="",
            ANTHROPIC_MODEL="fake",
            ANTHROPIC_DEFAULT_OPUS_MODEL="fake",
            ANTHROPIC_DEFAULT_SONNET_MODEL="fake",
            ANTHROPIC_DEFAULT_HAIKU_MODEL="fake",
            CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
            DISABLE_TELEMETRY="1",
            DISABLE_ERROR_REPORTING="1",
            DISABLE_AUTOUPDATER="1",
            CLAUDE_CODE_ATTRIBUTION_HEADER="0",
        )
        return (
            [str(bin_dir / "claude"), "-p", PROMPT, "--output-format", "json", "--allowedTools", "Bash"],
            env,
            "",
        )
    if name == "codex":
        env.update(CODEX_HOME=str(home / ".codex"), KAPITSA_API_KEY="x")
        (home / ".codex").mkdir(parents=True, exist_ok=True)
        overrides = [
            "analytics.enabled=false",
            "feedback.enabled=false",
            "check_for_update_on_startup=false",
            "model_provider=kapitsa",
            "model_providers.kapitsa.name=kapitsa",
            f"model_providers.kapitsa.base_url={base_url}/v1",
            "model_providers.kapitsa.wire_api=responses",
            "model_providers.kapitsa.env_key=KAPITSA_API_KEY",
        ]
        argv = [
            str(bin_dir / "codex"),
            "exec",
            "--skip-git-repo-check",
            "--ephemeral",
            "--color",
            "never",
            "-s",
            "workspace-write",
        ]
        for override in overrides:
            argv += ["-c", override]
        return argv + ["-m", "fake", PROMPT], env, ""
    if name == "opencode":
        config = {
            "provider": {
                "kapitsa": {
                    "npm": "@ai-sdk/openai-compatible",
                    "name": "kapitsa",
                    "options": {"baseURL": f"{base_url}/v1", "apiKey": "x"},
                    "models": {"fake": {"name": "fake"}},
                }
            },
            "model": "kapitsa/fake",
            "small_model": "kapitsa/fake",
            "share": "disabled",
            "autoupdate": False,
        }
        env.update(
            XDG_CONFIG_HOME=str(home / "config"),
            XDG_DATA_HOME=str(home / "data"),
            XDG_CACHE_HOME=str(home / "cache"),
            XDG_STATE_HOME=str(home / "state"),
            OPENCODE_CONFIG_CONTENT=json.dumps(config),
            OPENCODE_DISABLE_MODELS_FETCH="1",
            OPENCODE_DISABLE_AUTOUPDATE="1",
            OPENCODE_DISABLE_LSP_DOWNLOAD="1",
            OPENCODE_DISABLE_SHARE="1",
            OPENCODE_DISABLE_DEFAULT_PLUGINS="1",
        )
        # The prompt goes through stdin: `opencode run "text"` wraps it in literal quotes.
        return [str(bin_dir / "opencode"), "run", "--pure", "-m", "kapitsa/fake"], env, PROMPT
    return _pi_command(name, bin_dir, base_url, home, env)


PI_APIS = {
    "pi": "openai-completions",
    "pi-responses": "openai-responses",
    "pi-anthropic": "anthropic-messages",
}


def _pi_command(
    name: str, bin_dir: Path, base_url: str, home: Path, env: dict[str, str]
) -> tuple[list[str], dict[str, str], str | None]:
    """pi speaks each of the three APIs, depending on the provider's `api`."""
    api = PI_APIS[name]
    agent_dir = home / "pi-agent"
    agent_dir.mkdir(parents=True, exist_ok=True)
    root = base_url if api == "anthropic-messages" else f"{base_url}/v1"  # the Anthropic SDK adds /v1 itself
    model = {"id": "fake", "name": "fake", "contextWindow": 32768, "maxTokens": 8192}
    provider = {"baseUrl": root, "api": api, "apiKey": "KAPITSA_API_KEY", "models": [model]}
    (agent_dir / "models.json").write_text(json.dumps({"providers": {"kapitsa": provider}}))
    env.update(PI_CODING_AGENT_DIR=str(agent_dir), PI_OFFLINE="1", PI_TELEMETRY="0", KAPITSA_API_KEY="x")
    return (
        [str(bin_dir / "pi"), "-p", PROMPT, "--provider", "kapitsa", "--model", "fake", "--no-session"],
        env,
        "",
    )
