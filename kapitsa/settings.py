"""User settings: `KAPITSA_*` environment variables override the config file, which overrides defaults.

The config file is `config.toml` in the user config folder (`~/Library/Application Support/kapitsa` on
macOS, `$XDG_CONFIG_HOME/kapitsa` on Linux), or the file `KAPITSA_CONFIG` names. Example:

    default_model = "27b"
    port = 8484

    [catalog.my-27b]            # a user catalog entry (same keys as kapitsa/catalog.toml)
    name = "My 27B fine-tune"
    ...
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from kapitsa.errors import KapitsaError

APP_NAME = "kapitsa"
DEFAULT_PORT = 8484


def _user_dir(xdg_variable: str, xdg_default: str) -> Path:
    """macOS keeps app config and state in Application Support; elsewhere the XDG folders."""
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / APP_NAME
    base = os.environ.get(xdg_variable)
    return (Path(base) if base else Path.home() / xdg_default) / APP_NAME


def user_config_dir() -> Path:
    return _user_dir("XDG_CONFIG_HOME", ".config")


def user_state_dir() -> Path:
    return _user_dir("XDG_STATE_HOME", ".local/state")


def config_file_path() -> Path:
    override = os.environ.get("KAPITSA_CONFIG")
    return Path(override).expanduser() if override else user_config_dir() / "config.toml"


class KapitsaSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KAPITSA_", extra="ignore")

    default_model: str = "demo"
    """Model used when a command gets no `--model` (catalog alias, HF repo id, or folder)."""

    host: str = "127.0.0.1"
    """Address launchers use to reach (and start) the local server."""

    port: int = Field(DEFAULT_PORT, ge=1, le=65535)
    """Port launchers try first for a new server; the next free one is used when it is taken."""

    server_start_timeout_s: float = Field(600.0, gt=0)
    """How long a launcher waits for a server it started to answer `/health` (loading big weights is slow)."""

    state_dir: Path = Field(default_factory=user_state_dir)
    """kapitsa's own files: server logs, the Codex model catalog, pi backups, the token fallback file."""

    catalog: dict[str, dict[str, Any]] = {}
    """User catalog entries, merged over the built-in ones (same keys as kapitsa/catalog.toml)."""

    num_checkpoints: int = Field(4, ge=0)
    """Recurrent-state checkpoints the memory estimate reserves for the prefix cache."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (
            init_settings,
            env_settings,
            TomlConfigSettingsSource(settings_cls, toml_file=config_file_path()),
        )


def load_settings(**overrides: Any) -> KapitsaSettings:
    """Read settings; a bad value or a malformed config file becomes a one-line KapitsaError."""
    try:
        return KapitsaSettings(**overrides)
    except ValidationError as err:
        raise settings_error(err) from None
    except ValueError as err:  # TOML syntax errors
        raise KapitsaError(f"cannot read the config file {config_file_path()}: {err}") from None


_PROBLEMS = {
    "less_than_equal": "must be at most {le}",
    "less_than": "must be less than {lt}",
    "greater_than_equal": "must be at least {ge}",
    "greater_than": "must be more than {gt}",
    "int_parsing": "must be a whole number",
    "int_from_float": "must be a whole number",
    "float_parsing": "must be a number",
    "bool_parsing": "must be true or false",
}


def settings_error(err: ValidationError, *, flag_names: dict[str, str] | None = None) -> KapitsaError:
    """One line per bad setting, naming where it can be fixed; pydantic's own text never reaches the user."""
    problems = [_describe_problem(problem, flag_names or {}) for problem in err.errors()]
    return KapitsaError("; ".join(problems))


def _describe_problem(problem: Any, flag_names: dict[str, str]) -> str:
    field = ".".join(str(part) for part in problem["loc"]) or "settings"
    template = _PROBLEMS.get(problem["type"])
    context = problem.get("ctx") or {}
    what = template.format(**context) if template else str(problem["msg"]).lower()
    where = [f"--{flag_names[field]}"] if field in flag_names else []
    where.append(f"KAPITSA_{field.upper()}")
    if config_file_path().is_file():
        where.append(f"{field} in {config_file_path()}")
    return f"{field} {what} (got {problem['input']!r}): fix {' or '.join(where)}"
