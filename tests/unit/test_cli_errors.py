"""Every error the CLI prints is one `error: ...` line with the fix in it: no traceback, no pydantic prose."""

from __future__ import annotations

import sys

import pytest
from typer.testing import CliRunner

from kapitsa import cli
from kapitsa.errors import KapitsaError, ModelNotFound


@pytest.fixture(autouse=True)
def no_user_config(tmp_path, monkeypatch):
    monkeypatch.setenv("KAPITSA_CONFIG", str(tmp_path / "missing.toml"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    for name in ("KAPITSA_PORT", "KAPITSA_HOST", "KAPITSA_DEFAULT_MODEL"):
        monkeypatch.delenv(name, raising=False)


def run_main(monkeypatch, capsys, *args: str) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", ["kapitsa", *args])
    with pytest.raises(SystemExit) as exited:
        cli.main()
    return exited.value.code, capsys.readouterr().err


def assert_one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: "), err
    for library_text in ("Traceback", "pydantic", "validation error", "Input should", "Error:"):
        assert library_text not in err
    return lines[0]


@pytest.mark.parametrize(("port", "fix"), [("99999", "at most 65535"), ("-1", "at least")])
def test_serve_bad_port_is_one_line(monkeypatch, capsys, port, fix) -> None:
    code, err = run_main(monkeypatch, capsys, "serve", "--port", port)
    line = assert_one_error_line(err)
    assert code == 1
    assert fix in line and "--port" in line


def test_bad_env_port_names_the_variable_not_a_missing_config_file(monkeypatch, capsys, tmp_path) -> None:
    monkeypatch.setenv("KAPITSA_PORT", "abc")
    code, err = run_main(monkeypatch, capsys, "env")
    line = assert_one_error_line(err)
    assert code == 1
    assert "KAPITSA_PORT" in line and "whole number" in line
    assert "missing.toml" not in line  # that file does not exist: naming it sends the user nowhere


def test_usage_errors_use_the_same_prefix(monkeypatch, capsys) -> None:
    code, err = run_main(monkeypatch, capsys, "serve", "--port", "abc")
    line = assert_one_error_line(err)
    assert code == 2
    assert "--port" in line and "kapitsa serve --help" in line
    code, err = run_main(monkeypatch, capsys, "no-such-command")
    assert "no such command" in assert_one_error_line(err)


def test_kapitsa_error_keeps_its_message(monkeypatch, capsys) -> None:
    def fail(_shell):
        raise KapitsaError("something the user can fix")

    monkeypatch.setattr("kapitsa.commands.env.cmd_env", fail)
    code, err = run_main(monkeypatch, capsys, "env")
    assert code == 1
    assert err == "error: something the user can fix\n"


def test_help_says_plain_kapitsa_opens_the_tui() -> None:
    result = CliRunner().invoke(cli.app, ["--help"])
    assert result.exit_code == 0
    assert "with no command to open the TUI" in " ".join(result.output.split())


def test_unknown_alias_lists_the_catalog_like_pull() -> None:
    from kapitsa.opener import load_for_ref

    with pytest.raises(ModelNotFound) as raised:
        load_for_ref("72b")
    message = str(raised.value)
    assert "not a catalog alias" in message
    assert "27b" in message and "demo" in message


def test_input_ending_at_a_prompt_is_one_line(monkeypatch, capsys) -> None:
    def closed_stdin(shell):  # noqa: ANN001, ANN202
        raise EOFError

    monkeypatch.setattr("kapitsa.commands.env.cmd_env", closed_stdin)
    code, err = run_main(monkeypatch, capsys, "env")
    assert code == 1 and assert_one_error_line(err) == "error: aborted"


def test_an_unexpected_error_surfaces_as_itself(monkeypatch) -> None:
    def bug(shell):  # noqa: ANN001, ANN202
        raise RuntimeError("a bug")

    monkeypatch.setattr("kapitsa.commands.env.cmd_env", bug)
    monkeypatch.setattr(sys, "argv", ["kapitsa", "env"])
    with pytest.raises(RuntimeError, match="a bug"):  # not masked by the error handlers' own failure
        cli.main()
