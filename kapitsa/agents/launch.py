"""`kapitsa claude|codex|opencode|pi`: weights on disk, a server up, the agent configured, then exec.

`prepare_launch` does everything but the exec and returns what it will run, so the TUI can show it
and the tests can check it without starting an agent.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import NoReturn

from kapitsa import memory_estimate
from kapitsa.agents import claude, codex, opencode, pi
from kapitsa.agents.base import LaunchContext, exec_agent, find_binary
from kapitsa.agents.context import PLACEHOLDER_KEY, default_context
from kapitsa.agents.server import ServerHandle, ensure_server
from kapitsa.agents.window import WindowTooSmall, suggest_model, window_shortfall
from kapitsa.catalog import (
    Architecture,
    Catalog,
    ResolvedModel,
    arch_for_folder,
    load_catalog,
    resolve_model,
)
from kapitsa.errors import KapitsaError
from kapitsa.settings import KapitsaSettings

AGENTS: dict[str, ModuleType] = {"claude": claude, "codex": codex, "opencode": opencode, "pi": pi}


@dataclass(slots=True, frozen=True)
class LaunchPlan:
    agent: str
    command: list[str]
    env: dict[str, str]
    context: LaunchContext
    server: ServerHandle
    notes: tuple[str, ...] = ()  # what was done on the way (files written, server started)


def installed_agent_names() -> list[str]:
    return [name for name, module in AGENTS.items() if _binary_or_none(module)]


def _binary_or_none(module: ModuleType) -> str | None:
    try:
        return find_binary(module.BINARY, module.INSTALL, module.EXTRA_DIRS)
    except KapitsaError:
        return None


def model_limits(
    model: ResolvedModel, local_path: Path | None, usable_bytes: int | None, num_checkpoints: int
) -> tuple[int, int]:
    """Context window and output limit to tell the agent: the model's own, capped by what fits in memory."""
    arch = _architecture(model, local_path)
    if arch is None:
        return 32768, 8192
    context = arch.context_length
    if usable_bytes:
        bits = model.quant.bits_per_weight if model.quant else 16.0
        weights = memory_estimate.weights_bytes(arch, bits)
        fitting = memory_estimate.estimate(
            arch, usable_bytes=usable_bytes, weight_bytes=weights, num_checkpoints=num_checkpoints
        ).max_context
        if fitting >= memory_estimate.MINIMUM_CONTEXT:
            context = min(context, fitting)
    return context, min(arch.max_output, context // 2)


def _architecture(model: ResolvedModel, local_path: Path | None) -> Architecture | None:
    if model.entry is not None and model.entry.arch is not None:
        return model.entry.arch
    folder = local_path or model.path
    if folder is not None and (folder / "config.json").is_file():
        try:
            return arch_for_folder(folder)
        except KapitsaError:
            return None
    return None


def prepare_launch(
    agent: str,
    model_ref: str,
    args: list[str],
    *,
    settings: KapitsaSettings,
    api_key: str | None,
    environ: Mapping[str, str] | None = None,
    ensure_weights: Callable[[ResolvedModel], Path | None] | None = None,
    usable_bytes: int | None = None,
    serve_args: tuple[str, ...] = (),
) -> LaunchPlan:
    """Resolve the model, make sure a server serves it, configure the agent. Does not exec."""
    module = AGENTS.get(agent)
    if module is None:
        raise KapitsaError(f"unknown agent {agent!r}; known: {', '.join(AGENTS)}")
    env_in = dict(os.environ if environ is None else environ)
    binary = find_binary(module.BINARY, module.INSTALL, module.EXTRA_DIRS, env_in.get("PATH"))
    catalog = load_catalog(settings.catalog)
    model = resolve_model(model_ref, catalog)
    local_path = ensure_weights(model) if ensure_weights else None
    context, max_output = model_limits(model, local_path, usable_bytes, settings.num_checkpoints)
    check_window(
        agent,
        model,
        context,
        catalog=catalog,
        usable_bytes=usable_bytes,
        num_checkpoints=settings.num_checkpoints,
    )
    server = ensure_server(
        model_ref=model_ref,
        wanted_ids=(model_ref, model.display_name, model.repo_id or ""),
        host=settings.host,
        first_port=settings.port,
        api_key=api_key,
        log_dir=settings.state_dir / "logs",
        timeout_s=settings.server_start_timeout_s,
        environ=env_in,
        serve_args=serve_args,
    )
    ctx = LaunchContext(
        base_url=server.base_url,
        model_id=server.model_id,
        model_name=model.entry.name if model.entry else model.display_name,
        context_window=context,
        max_output=max_output,
        api_key=api_key or PLACEHOLDER_KEY,
        state_dir=settings.state_dir,
    )
    return _plan(agent, module, binary, ctx, server, args, env_in)


def check_window(
    agent: str,
    model: ResolvedModel,
    context_window: int,
    *,
    catalog: Catalog,
    usable_bytes: int | None,
    num_checkpoints: int,
) -> None:
    """Refuse, in one line, a model whose window cannot hold the agent's first request (it would get a 400),
    naming a catalog model that can. Runs before any server starts."""
    model_name = model.entry.alias if model.entry else model.display_name
    shortfall = window_shortfall(agent, model_name, context_window)
    if shortfall is None:
        return
    alias = suggest_model(
        catalog, agent, exclude=model_name, usable_bytes=usable_bytes, num_checkpoints=num_checkpoints
    )
    hint = f"try `kapitsa {agent} --model {alias}`" if alias else "no catalog model holds it on this machine"
    raise WindowTooSmall(f"{shortfall}; {hint}")


def _plan(
    agent: str,
    module: ModuleType,
    binary: str,
    ctx: LaunchContext,
    server: ServerHandle,
    args: list[str],
    environ: dict[str, str],
) -> LaunchPlan:
    notes = [
        f"started `kapitsa serve` (pid {server.pid}, log {server.log_path})"
        if server.started
        else f"reusing the kapitsa server at {server.base_url}"
    ]
    command, additions, more_notes = _configure(agent, module, binary, ctx, args, environ)
    return LaunchPlan(
        agent=agent,
        command=command,
        env={**environ, **additions},
        context=ctx,
        server=server,
        notes=(*notes, *more_notes),
    )


def _configure(
    agent: str,
    module: ModuleType,
    binary: str,
    ctx: LaunchContext,
    args: list[str],
    environ: Mapping[str, str],
) -> tuple[list[str], dict[str, str], list[str]]:
    """The agent's argv and environment additions, writing the files it needs (Codex catalog, pi models)."""
    notes: list[str] = []
    if agent == "codex":
        instructions = codex.base_instructions(binary, ctx.state_dir, environ)
        catalog = codex.write_catalog(ctx, instructions) if instructions else None
        notes.append(
            f"Codex model catalog: {catalog}"
            if catalog
            else "could not read Codex's base instructions; passing model_context_window only"
        )
        command = codex.build_command(args, ctx, binary, catalog)
    else:
        if agent == "pi":
            notes.append(
                f"added the kapitsa provider to {pi.prepare(ctx, environ)} (undo: kapitsa pi --restore)"
            )
        command = module.build_command(args, ctx, binary)
    return command, module.build_env(ctx.base_url, ctx.model_id, ctx, environ), notes


def agent_invocation(
    agent: str,
    server_url: str,
    model: str,
    args: Sequence[str] = (),
    *,
    settings: KapitsaSettings | None = None,
    api_key: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[list[str], dict[str, str]]:
    """argv and environment additions that run `agent` against an already running server (the TUI's case).

    Writes what the agent needs (Codex's catalog, pi's provider) but starts no server. The caller runs
    `subprocess.run(argv, env={**os.environ, **additions})`.
    """
    module = AGENTS.get(agent)
    if module is None:
        raise KapitsaError(f"unknown agent {agent!r}; known: {', '.join(AGENTS)}")
    env_in = dict(os.environ if environ is None else environ)
    binary = find_binary(module.BINARY, module.INSTALL, module.EXTRA_DIRS, env_in.get("PATH"))
    ctx = default_context(server_url, model, settings, api_key)
    command, additions, _notes = _configure(agent, module, binary, ctx, list(args), env_in)
    return command, additions


def run_plan(plan: LaunchPlan) -> NoReturn:
    exec_agent(plan.command, plan.env)
