"""pi: a `kapitsa` provider merged into pi's models.json (backed up, atomic, undone by `--restore`).

pi reads providers only from that file (or a whole private agent dir, which would hide the user's
auth and sessions), so kapitsa upserts one provider and tags the models it manages with `_kapitsa`.
Everything else in the file is kept as it was.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kapitsa.agents.base import LaunchContext, reject_args
from kapitsa.agents.config_files import ManagedFile, merge_json, restore
from kapitsa.agents.context import default_context
from kapitsa.errors import KapitsaError

BINARY = "pi"
INSTALL = "npm install -g @earendil-works/pi-coding-agent"
EXTRA_DIRS = ()
PROVIDER = "kapitsa"
API_KEY_ENV = "KAPITSA_API_KEY"
MARKER = "_kapitsa"


def models_file(environ: Mapping[str, str]) -> Path:
    agent_dir = environ.get("PI_CODING_AGENT_DIR")
    home = Path(environ["HOME"]) if environ.get("HOME") else Path.home()
    return (Path(agent_dir).expanduser() if agent_dir else home / ".pi" / "agent") / "models.json"


def managed_file(environ: Mapping[str, str], state_dir: Path) -> ManagedFile:
    return ManagedFile(path=models_file(environ), state_dir=state_dir / "pi")


def model_entry(ctx: LaunchContext) -> dict[str, Any]:
    return {
        "id": ctx.model_id,
        "name": f"{ctx.model_name} (kapitsa)",
        "reasoning": ctx.reasoning,
        "input": ["text"],
        "contextWindow": ctx.context_window,
        "maxTokens": ctx.max_output,
        MARKER: True,
    }


def upsert_provider(ctx: LaunchContext) -> Any:
    def transform(config: dict[str, Any]) -> dict[str, Any]:
        providers = dict(config.get("providers") or {})
        provider = dict(providers.get(PROVIDER) or {})
        models = [
            m
            for m in provider.get("models") or []
            if not (isinstance(m, dict) and m.get("id") == ctx.model_id)
        ]
        provider.update({"baseUrl": ctx.openai_base_url, "api": "openai-completions", "apiKey": API_KEY_ENV})
        provider["models"] = [*models, model_entry(ctx)]
        providers[PROVIDER] = provider
        return {**config, "providers": providers}

    return transform


def remove_managed(config: dict[str, Any]) -> dict[str, Any]:
    providers = dict(config.get("providers") or {})
    provider = providers.get(PROVIDER)
    if not isinstance(provider, dict):
        return config
    kept = [m for m in provider.get("models") or [] if not (isinstance(m, dict) and m.get(MARKER))]
    if kept:
        providers[PROVIDER] = {**provider, "models": kept}
    else:
        providers.pop(PROVIDER)
    result = {**config, "providers": providers}
    if not providers:
        result.pop("providers")
    return result


def prepare(ctx: LaunchContext, environ: Mapping[str, str]) -> Path:
    managed = managed_file(environ, ctx.state_dir)
    merge_json(managed, upsert_provider(ctx))
    return managed.path


def restore_config(environ: Mapping[str, str], state_dir: Path) -> str:
    return restore(managed_file(environ, state_dir), remove_managed)


def build_env(
    server_url: str, model: str, ctx: LaunchContext | None = None, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    ctx = ctx or default_context(server_url, model)
    return {API_KEY_ENV: ctx.api_key}


def build_command(args: list[str], ctx: LaunchContext | None = None, binary: str | None = None) -> list[str]:
    """Needs the context: pi takes its provider and model only from the command line (after `prepare`)."""
    if ctx is None:
        raise KapitsaError("pi needs the launch context; use kapitsa.agents.launch.agent_invocation")
    reject_args(args, ("--provider", "--model"), "kapitsa picks the model; use `kapitsa pi --model X`")
    return [binary or BINARY, "--provider", PROVIDER, "--model", ctx.model_id, *args]
