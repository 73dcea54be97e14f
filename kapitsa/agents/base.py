"""What every agent launcher shares: the launch context, finding the binary, and handing over the process.

Each agent module (claude.py, codex.py, opencode.py, pi.py) exposes `BINARY`, `INSTALL`,
`build_env(ctx, environ)` and `build_command(ctx, binary, args)`; the launcher in `launch.py` puts
them together and ends in `exec_agent`, which replaces kapitsa's process with the agent's.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from kapitsa.errors import KapitsaError


@dataclass(slots=True, frozen=True)
class LaunchContext:
    """Everything an agent needs to talk to the local server."""

    base_url: str  # server root, no /v1: http://127.0.0.1:8484
    model_id: str  # the id the server answers to
    model_name: str  # human-readable name for pickers
    context_window: int  # tokens the model takes in (capped by what fits in memory)
    max_output: int  # tokens the model may generate in one answer
    api_key: str  # the kapitsa token, or a placeholder the loopback server ignores
    state_dir: Path  # kapitsa's own folder for files an agent must read (Codex catalog, pi backups)
    reasoning: bool = True  # the model thinks before answering (Qwen3.5/3.6, Nemotron)

    @property
    def openai_base_url(self) -> str:
        return f"{self.base_url}/v1"


class AgentNotInstalled(KapitsaError):
    """The agent's binary is not on PATH."""


def find_binary(
    name: str, install_hint: str, extra_dirs: Iterable[Path] = (), search_path: str | None = None
) -> str:
    """The agent's executable: PATH (or `search_path`) first, then the agent's own install folders."""
    found = shutil.which(name, path=search_path)
    if found:
        return found
    for folder in extra_dirs:
        candidate = folder / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    raise AgentNotInstalled(f"`{name}` was not found on PATH. Install it with:\n  {install_hint}")


def reject_args(args: list[str], flags: Iterable[str], why: str) -> None:
    """Refuse user arguments that would fight the settings kapitsa passes (e.g. a second --model)."""
    taken = set(flags)
    for arg in args:
        if arg.split("=", 1)[0] in taken:
            raise KapitsaError(f"`{arg}` conflicts with kapitsa's own setting: {why}")


def exec_agent(cmd: list[str], env: Mapping[str, str]) -> NoReturn:
    """Replace this process with the agent (stdin, stdout and the terminal stay the agent's)."""
    try:
        os.execvpe(cmd[0], cmd, dict(env))
    except OSError as err:
        raise KapitsaError(f"could not start {cmd[0]}: {err}") from err
