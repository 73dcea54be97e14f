"""Bodies of `kapitsa pull|ls|rm|doctor|env|token|claude|codex|opencode|pi`: call the owning module,
render the result. stdout carries results (or JSON); progress and diagnostics go to stderr.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kapitsa.catalog import ResolvedModel, load_catalog
from kapitsa.errors import KapitsaError
from kapitsa.settings import KapitsaSettings, load_settings


def _err(message: str) -> None:
    print(message, file=sys.stderr)


def _gb(num_bytes: int) -> str:
    return f"{num_bytes / 1e9:.2f} GB"


def _json_default(value: Any) -> Any:
    return str(value) if isinstance(value, Path) else repr(value)


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=_json_default))


def pull_with_progress(ref: str, settings: KapitsaSettings) -> Any:
    """`hub.pull` with a rich progress bar on stderr."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    from kapitsa import hub

    catalog = load_catalog(settings.catalog)
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        console=_stderr_console(),
        transient=True,
    ) as bar:
        task = bar.add_task(f"pulling {ref}", total=None)

        def on_progress(p: hub.PullProgress) -> None:
            bar.update(
                task,
                total=p.bytes_total,
                completed=p.bytes_done,
                description=f"{p.repo_id} [{p.files_done + 1}/{p.files_total}] {p.file_name}",
            )

        return hub.pull(ref, catalog=catalog, on_progress=on_progress)


def _stderr_console() -> Any:
    from rich.console import Console

    return Console(stderr=True)


def cmd_pull(ref: str) -> None:
    result = pull_with_progress(ref, load_settings())
    if not result.commit:  # a local folder or the packaged demo: nothing to download
        print(f"{ref} is on disk already: {result.path}")
        return
    fetched = (
        f"downloaded {_gb(result.downloaded_bytes)}" if result.downloaded_bytes else "already downloaded"
    )
    print(
        f"{result.repo_id} @ {result.commit[:12]}: {result.num_files} files, {_gb(result.num_bytes)}, "
        f"verified, {fetched}\n{result.path}"
    )


def cmd_ls(json_out: bool) -> None:
    from kapitsa import hub

    settings = load_settings()
    models = hub.list_local(catalog=load_catalog(settings.catalog))
    if json_out:
        print_json([asdict(m) for m in models])
        return
    if not models:
        print("no models in the Hugging Face cache; try `kapitsa pull 4b`")
        return
    print(f"{'REPO':<56} {'ALIAS':<16} {'SIZE':>10}")
    for m in models:
        print(f"{m.repo_id:<56} {', '.join(m.refs) or '-':<16} {_gb(m.size_bytes):>10}")


def cmd_rm(ref: str) -> None:
    from kapitsa import hub

    settings = load_settings()
    removed = hub.remove(ref, catalog=load_catalog(settings.catalog))
    print(f"removed {removed.repo_id}, freed {_gb(removed.freed_bytes)}")


def cmd_doctor(json_out: bool) -> None:
    from kapitsa.doctor import build_report, probe_hardware, render_report

    settings = load_settings()
    report = build_report(
        probe_hardware(), load_catalog(settings.catalog), num_checkpoints=settings.num_checkpoints
    )
    print_json(report.to_json_dict()) if json_out else print(render_report(report))


def cmd_env(shell: str | None) -> None:
    from kapitsa.env_cmd import env_lines
    from kapitsa.token import get_token

    settings = load_settings()
    token = get_token(settings.state_dir)
    if token.warning:
        _err(f"warning: {token.warning}")
    print(env_lines(f"http://{settings.host}:{settings.port}", token.token, shell).text)


def cmd_token(action: str) -> None:
    from kapitsa import token as tokens

    settings = load_settings()
    actions = {"show": tokens.get_token, "rotate": tokens.rotate_token, "clear": tokens.clear_token}
    if action not in actions:
        raise KapitsaError(f"unknown action {action!r}; use show, rotate or clear")
    state = actions[action](settings.state_dir)
    if state.warning:
        _err(f"warning: {state.warning}")
    if action == "clear":
        print(f"token cleared ({state.location})")
    elif state.token is None:
        _err(
            "no token set: the local server accepts any key on 127.0.0.1. `kapitsa token rotate` creates one."
        )
    else:
        print(state.token)
        _err(
            f"stored in {state.location}"
            + (" (servers started earlier keep the old token until restarted)" if action == "rotate" else "")
        )


def _ensure_weights(settings: KapitsaSettings):  # type: ignore[no-untyped-def]
    from kapitsa import hub

    def ensure(model: ResolvedModel) -> Path | None:
        if model.kind == "path" or model.repo_id is None:
            return model.path
        local = hub.find_local(model.repo_id)
        if local is not None:
            return local.path  # blobs only enter the cache after verification
        _err(f"{model.repo_id} is not downloaded yet; pulling it")
        return pull_with_progress(model.ref, settings).path

    return ensure


def cmd_agent(
    agent: str, model: str | None, args: list[str], speculative: str, restore: bool = False
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
        _err(f"warning: {token.warning}")
    plan = launch.prepare_launch(
        agent,
        model or settings.default_model,
        list(args),
        settings=settings,
        api_key=token.token,
        ensure_weights=_ensure_weights(settings),
        usable_bytes=probe_hardware().usable_memory_bytes,
        serve_args=("--speculative", speculative) if speculative != "none" else (),
    )
    for note in plan.notes:
        _err(note)
    _err(
        f"{agent} → {plan.server.base_url} model {plan.context.model_id} "
        f"(context {plan.context.context_window}, output {plan.context.max_output})"
    )
    launch.run_plan(plan)
