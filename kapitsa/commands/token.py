"""`kapitsa token show|rotate|clear`: the API token kept in the OS keyring."""

from __future__ import annotations

from kapitsa.commands.output import note
from kapitsa.errors import KapitsaError
from kapitsa.settings import load_settings


def cmd_token(action: str) -> None:
    from kapitsa import token as tokens

    settings = load_settings()
    actions = {"show": tokens.get_token, "rotate": tokens.rotate_token, "clear": tokens.clear_token}
    if action not in actions:
        raise KapitsaError(f"unknown action {action!r}; use show, rotate or clear")
    state = actions[action](settings.state_dir)
    if state.warning:
        note(f"warning: {state.warning}")
    if action == "clear":
        print(f"token cleared ({state.location})")
    elif state.token is None:
        note(
            "no token set: the local server accepts any key on 127.0.0.1. `kapitsa token rotate` creates one."
        )
    else:
        print(state.token)
        restart = (
            " (servers started earlier keep the old token until restarted)" if action == "rotate" else ""
        )
        note(f"stored in {state.location}{restart}")
