"""`kapitsa env`, the token store (keyring or 0600 file), and settings precedence."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import keyring
import pytest
from keyring.backend import KeyringBackend
from typer.testing import CliRunner

from kapitsa import token as tokens
from kapitsa.cli import app
from kapitsa.errors import InvalidRequest, KapitsaError
from kapitsa.settings import load_settings
from kapitsa.shell_env import env_lines, normalize_shell


@pytest.mark.parametrize(
    ("shell", "line"),
    [
        ("bash", "export OPENAI_BASE_URL='http://127.0.0.1:8484/v1'"),
        ("zsh", "export ANTHROPIC_BASE_URL='http://127.0.0.1:8484'"),
        ("fish", "set -gx OPENAI_API_KEY 'kapitsa'"),
        ("powershell", "$env:ANTHROPIC_API_KEY = 'kapitsa'"),
    ],
)
def test_env_lines_per_shell(shell: str, line: str) -> None:
    assert line in env_lines("http://127.0.0.1:8484", None, shell).lines


def test_env_values_are_quoted_for_each_shell() -> None:
    assert "export OPENAI_API_KEY='a'\"'\"'b'" in env_lines("http://h", "a'b", "bash").lines
    assert "$env:OPENAI_API_KEY = 'a''b'" in env_lines("http://h", "a'b", "pwsh").lines
    assert "set -gx OPENAI_API_KEY 'a\\'b'" in env_lines("http://h", "a'b", "fish").lines
    assert normalize_shell("/usr/bin/zsh") == "zsh"
    with pytest.raises(InvalidRequest, match="unknown shell"):
        normalize_shell("tcsh")


class MemoryKeyring(KeyringBackend):
    priority = 10  # type: ignore[assignment]

    def __init__(self) -> None:
        super().__init__()
        self.store: dict[tuple[str, str], str] = {}

    def get_password(self, service: str, username: str) -> str | None:
        return self.store.get((service, username))

    def set_password(self, service: str, username: str, password: str) -> None:
        self.store[(service, username)] = password

    def delete_password(self, service: str, username: str) -> None:
        self.store.pop((service, username), None)


class BrokenKeyring(MemoryKeyring):
    def set_password(self, service: str, username: str, password: str) -> None:
        raise keyring.errors.PasswordSetError("locked")


@pytest.fixture
def restore_keyring():
    before = keyring.get_keyring()
    yield
    keyring.set_keyring(before)


def test_token_in_the_keyring(tmp_path: Path, restore_keyring) -> None:
    backend = MemoryKeyring()
    keyring.set_keyring(backend)
    created = tokens.rotate_token(tmp_path)
    assert created.storage == "keyring" and created.token and created.token.startswith("kap-")
    assert backend.store[(tokens.SERVICE, tokens.ACCOUNT)] == created.token
    assert tokens.get_token(tmp_path).token == created.token
    assert not (tmp_path / tokens.FILE_NAME).exists()
    assert tokens.rotate_token(tmp_path).token != created.token
    assert tokens.clear_token(tmp_path).token is None and tokens.get_token(tmp_path).token is None


def test_without_a_keyring_the_token_goes_to_a_0600_file(tmp_path: Path, restore_keyring) -> None:
    from keyring.backends import fail

    keyring.set_keyring(fail.Keyring())
    created = tokens.rotate_token(tmp_path)
    path = tmp_path / tokens.FILE_NAME
    assert created.storage == "file" and created.warning and "0600" in created.warning
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert tokens.get_token(tmp_path).token == created.token
    tokens.clear_token(tmp_path)
    assert not path.exists()


def test_a_failing_keyring_falls_back_without_crashing(tmp_path: Path, restore_keyring) -> None:
    keyring.set_keyring(BrokenKeyring())
    created = tokens.rotate_token(tmp_path)
    assert created.storage == "file" and "keyring write failed" in (created.warning or "")
    assert tokens.get_token(tmp_path).token == created.token


def test_settings_file_then_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "config.toml"
    config.write_text('port = 9100\ndefault_model = "27b"\n[catalog.mine]\npackage_path = "x"\nname = "M"\n')
    monkeypatch.setenv("KAPITSA_CONFIG", str(config))
    settings = load_settings()
    assert (settings.port, settings.default_model) == (9100, "27b") and "mine" in settings.catalog
    monkeypatch.setenv("KAPITSA_PORT", "9200")
    assert load_settings().port == 9200
    config.write_text("port = [")
    with pytest.raises(KapitsaError, match="config file"):
        load_settings()
    monkeypatch.delenv("KAPITSA_PORT")
    config.write_text("port = 99999")
    with pytest.raises(
        KapitsaError,
        match=r"port must be at most 65535 \(got 99999\): fix KAPITSA_PORT or port in .*config.toml",
    ):
        load_settings()


def test_cli_env_and_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restore_keyring) -> None:
    from keyring.backends import fail

    keyring.set_keyring(fail.Keyring())
    monkeypatch.setenv("KAPITSA_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("KAPITSA_CONFIG", str(tmp_path / "none.toml"))
    runner = CliRunner()
    out = runner.invoke(app, ["env", "--shell", "fish"], catch_exceptions=False)
    assert out.exit_code == 0 and "set -gx OPENAI_API_KEY 'kapitsa'" in out.output
    rotated = runner.invoke(app, ["token", "rotate"], catch_exceptions=False)
    token = rotated.stdout.strip().splitlines()[0]
    assert rotated.exit_code == 0 and token.startswith("kap-")
    assert f"set -gx OPENAI_API_KEY '{token}'" in runner.invoke(app, ["env", "--shell", "fish"]).stdout
    bogus = runner.invoke(app, ["token", "bogus"])
    assert bogus.exit_code != 0 and isinstance(bogus.exception, KapitsaError)
    assert os.path.exists(tmp_path / tokens.FILE_NAME)


def test_shell_detection(monkeypatch: pytest.MonkeyPatch) -> None:
    import shellingham

    from kapitsa.shell_env import detect_shell

    monkeypatch.setattr(shellingham, "detect_shell", lambda: ("pwsh", "/usr/bin/pwsh"))
    assert detect_shell() == "powershell"
    assert env_lines("http://h", None).shell == "powershell"

    def undetectable():
        raise shellingham.ShellDetectionFailure()

    monkeypatch.setattr(shellingham, "detect_shell", undetectable)
    monkeypatch.setenv("SHELL", "/usr/local/bin/fish")
    assert detect_shell() == "fish"
    monkeypatch.setenv("SHELL", "/bin/tcsh")
    assert detect_shell() == "bash"
