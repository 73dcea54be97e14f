"""`kapitsa claude|codex|opencode|pi`: make sure the weights and a server are there, then exec the agent."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from kapitsa.catalog import ResolvedModel
from kapitsa.commands.output import note
from kapitsa.settings import KapitsaSettings, load_settings


def cmd_agent(
    agent: str,
    model: str | None,
    args: list[str],
    *,
    speculative: str | None = None,
    restore: bool = False,
) -> None:
    from kapitsa.agents import launch

    settings = load_settings()
    if restore:
        from kapitsa.agents import pi

        print(pi.restore_config(dict(os.environ), settings.state_dir))
        return
    from kapitsa.doctor import probe_hardware
    from kapitsa.token import get_token

    token = get_token(settings.state_dir)
    if token.warning:
        note(f"warning: {token.warning}")
    plan = launch.prepare_launch(
        agent,
        model or settings.default_model,
        list(args),
        settings=settings,
        api_key=token.token,
        ensure_weights=_ensure_weights(settings),
        usable_bytes=probe_hardware().usable_memory_bytes,
        serve_args=("--speculative", speculative) if speculative else (),
    )
    for line in plan.notes:
        note(line)
    note(
        f"{agent} → {plan.server.base_url} model {plan.context.model_id} "
        f"(context {plan.context.context_window}, output {plan.context.max_output})"
    )
    launch.run_plan(plan)


def _ensure_weights(settings: KapitsaSettings) -> Callable[[ResolvedModel], Path | None]:
    from kapitsa import hub
    from kapitsa.commands.pull import pull_with_progress

    def ensure(model: ResolvedModel) -> Path | None:
        if model.kind == "path" or model.repo_id is None:
            return model.path
        local = hub.find_local(model.repo_id)
        if local is not None:
            return local.path  # blobs only enter the cache after verification
        note(f"{model.repo_id} is not downloaded yet; pulling it")
        return pull_with_progress(model.ref, settings).path

    return ensure
