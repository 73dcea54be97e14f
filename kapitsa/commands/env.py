"""`kapitsa env`: export lines pointing SDKs and IDEs at the local server, in the user's shell's syntax."""

from __future__ import annotations

from kapitsa.commands.output import note
from kapitsa.settings import load_settings


def cmd_env(shell: str | None) -> None:
    from kapitsa.server_state import http_url, running_server
    from kapitsa.shell_env import env_lines
    from kapitsa.token import get_token

    settings = load_settings()
    token = get_token(settings.state_dir)
    if token.warning:
        note(f"warning: {token.warning}")
    server = running_server(
        settings.state_dir
    )  # the port a running server really got, else the configured one
    url = server.url if server is not None else http_url(settings.host, settings.port)
    print(env_lines(url, token.token, shell).text)
