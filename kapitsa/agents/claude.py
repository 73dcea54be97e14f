"""Claude Code: configured through the environment only; nothing under ~/.claude is written.

Every model tier (opus, sonnet, haiku), the sub-agent model and background tasks map to the local
model (../shared/docs/agents-integration.md §1.2, mirroring Ollama's launcher).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from kapitsa.agents.base import LaunchContext, reject_args
from kapitsa.agents.context import default_context

BINARY = "claude"
INSTALL = "npm install -g @anthropic-ai/claude-code"
EXTRA_DIRS = (Path.home() / ".local" / "bin", Path.home() / ".claude" / "local")


def build_env(
    server_url: str, model: str, ctx: LaunchContext | None = None, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The variables to add to the agent's environment."""
    ctx = ctx or default_context(server_url, model)
    model = ctx.model_id
    return {
        "ANTHROPIC_BASE_URL": ctx.base_url,
        "ANTHROPIC_AUTH_TOKEN": ctx.api_key,  # sent as Authorization: Bearer
        "ANTHROPIC_API_KEY": "",  # an inherited real key would be sent too and prompt for approval
        "ANTHROPIC_MODEL": model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
        "ANTHROPIC_SMALL_FAST_MODEL": model,  # deprecated name, still read by older versions
        "CLAUDE_CODE_SUBAGENT_MODEL": model,
        "CLAUDE_CODE_AUTO_COMPACT_WINDOW": str(ctx.context_window),
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(ctx.max_output),
        # Per-conversation billing header would change the system prompt and defeat the prefix cache.
        "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_FEEDBACK_COMMAND": "1",
        "CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY": "1",
        "API_TIMEOUT_MS": "3000000",  # long prefills on a laptop
    }


def build_command(args: list[str], ctx: LaunchContext | None = None, binary: str | None = None) -> list[str]:
    reject_args(args, ("--model",), "kapitsa picks the model; use `kapitsa claude --model X`")
    model = ["--model", ctx.model_id] if ctx else []  # ANTHROPIC_MODEL selects it too
    return [binary or BINARY, *model, *args]
