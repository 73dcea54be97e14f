"""`kapitsa env`: export lines pointing SDKs and IDEs at the local server, in the user's shell's syntax."""

from __future__ import annotations

from kapitsa.commands.output import note
from kapitsa.settings import load_settings


def cmd_env(shell: str | None) -> None:
    from kapitsa.shell_env import env_lines
    from kapitsa.token import get_token

    settings = load_settings()
    token = get_token(settings.state_dir)
    if token.warning:
        note(f"warning: {token.warning}")
    print(env_lines(f"http://{settings.host}:{settings.port}", token.token, shell).text)
