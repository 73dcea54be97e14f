"""Export lines that point SDKs and IDEs at the local server, in the user's shell's syntax (`kapitsa env`, the TUI)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kapitsa.errors import InvalidRequest

Shell = Literal["bash", "zsh", "fish", "powershell"]
SHELLS: tuple[Shell, ...] = ("bash", "zsh", "fish", "powershell")
_ALIASES = {
    "sh": "bash",
    "dash": "bash",
    "ksh": "bash",
    "pwsh": "powershell",
    "powershell.exe": "powershell",
    "pwsh.exe": "powershell",
}


@dataclass(slots=True, frozen=True)
class EnvLines:
    shell: Shell
    variables: dict[str, str]
    lines: tuple[str, ...]

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


def normalize_shell(name: str) -> Shell:
    key = Path(name.strip().lower()).name
    key = _ALIASES.get(key, key)
    if key not in SHELLS:
        raise InvalidRequest(f"unknown shell {name!r}; use one of: {', '.join(SHELLS)}")
    return key  # type: ignore[return-value]


def detect_shell() -> Shell:
    """The shell this command runs under (shellingham), else $SHELL, else bash."""
    try:
        import shellingham
    except ImportError:
        shellingham = None  # type: ignore[assignment]
    if shellingham is not None:
        try:
            return normalize_shell(shellingham.detect_shell()[0])
        except (shellingham.ShellDetectionFailure, RuntimeError, InvalidRequest):
            pass
    try:
        return normalize_shell(os.environ.get("SHELL", "bash"))
    except InvalidRequest:
        return "bash"


def server_variables(base_url: str, api_key: str | None) -> dict[str, str]:
    """OpenAI SDKs want the /v1 base, Anthropic's the server root. Any key works on loopback without a token."""
    key = api_key or "kapitsa"
    return {
        "OPENAI_BASE_URL": f"{base_url}/v1",
        "OPENAI_API_BASE": f"{base_url}/v1",  # older OpenAI clients and LangChain
        "OPENAI_API_KEY": key,
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": key,
    }


def _quote(shell: Shell, value: str) -> str:
    if shell == "powershell":
        return "'" + value.replace("'", "''") + "'"
    if shell == "fish":
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return "'" + value.replace("'", "'\"'\"'") + "'"


def format_line(shell: Shell, name: str, value: str) -> str:
    quoted = _quote(shell, value)
    if shell == "fish":
        return f"set -gx {name} {quoted}"
    if shell == "powershell":
        return f"$env:{name} = {quoted}"
    return f"export {name}={quoted}"


def env_lines(base_url: str, api_key: str | None, shell: str | None = None) -> EnvLines:
    chosen = normalize_shell(shell) if shell else detect_shell()
    variables = server_variables(base_url, api_key)
    header = f"# kapitsa server at {base_url} (start it with `kapitsa serve`)"
    lines = (header, *(format_line(chosen, k, v) for k, v in variables.items()))
    return EnvLines(shell=chosen, variables=variables, lines=lines)


def export_lines(base_url: str, api_key: str | None = None, shell: str | None = None) -> tuple[str, ...]:
    """Just the lines (the TUI shows them ready to copy)."""
    return env_lines(base_url, api_key, shell).lines
