"""`kapitsa doctor` and `kapitsa ls`: rich tables in colour on a terminal, plain text when piped, JSON with --json."""

from __future__ import annotations

import io
import json
import re
import sys
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from kapitsa.catalog import load_catalog
from kapitsa.cli import app
from kapitsa.commands import doctor as doctor_command
from kapitsa.commands import ls as ls_command
from kapitsa.commands import output
from kapitsa.doctor import RECORDED_PROFILES, build_report
from kapitsa.hub import LocalModel

ANSI = "\x1b["
ANSI_CODE = re.compile(r"\x1b\[[0-9;]*m")
MODELS = [
    LocalModel("mlx-community/Qwen3.5-4B-4bit", ("4b",), 2_800_000_000, Path("/hf/4b"), ("abc",), 0.0),
    LocalModel("someone/other-model", (), 12_000_000, Path("/hf/other"), ("def",), 0.0),
]


@pytest.fixture(autouse=True)
def no_user_config(tmp_path, monkeypatch):
    monkeypatch.setenv("KAPITSA_CONFIG", str(tmp_path / "missing.toml"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))


@pytest.fixture
def terminal(monkeypatch) -> io.StringIO:
    """Stdout as a colour terminal for both commands; returns what they write to it."""
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=120, color_system="standard")
    for module in (doctor_command, ls_command):
        monkeypatch.setattr(module, "terminal_console", lambda: console)
    return buffer


def test_terminal_console_only_for_a_terminal(monkeypatch) -> None:
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    assert output.terminal_console() is None
    tty = io.StringIO()
    tty.isatty = lambda: True  # type: ignore[method-assign]
    monkeypatch.setattr(sys, "stdout", tty)
    assert isinstance(output.terminal_console(), Console)


def test_piped_doctor_and_ls_are_plain_text() -> None:
    runner = CliRunner()
    doctor = runner.invoke(app, ["doctor"], catch_exceptions=False)
    assert doctor.exit_code == 0 and ANSI not in doctor.stdout
    assert "MAX CONTEXT" in doctor.stdout and "┃" not in doctor.stdout
    ls = runner.invoke(app, ["ls"], catch_exceptions=False)
    assert ls.exit_code == 0 and ANSI not in ls.stdout


def test_doctor_on_a_terminal_is_a_coloured_table(terminal) -> None:
    report = build_report(RECORDED_PROFILES["m4-pro-48gb"], load_catalog())
    doctor_command.print_doctor(report, json_out=False)
    assert ANSI in terminal.getvalue()
    text = ANSI_CODE.sub("", terminal.getvalue())
    header = next(line for line in text.splitlines() if "max context" in line)
    assert "┃" in header and "weights" in header and "verdict" in header
    row_27b = next(line for line in text.splitlines() if "│" in line and " 27b " in line)
    assert "15.4 GB" in row_27b and "fits" in row_27b
    assert "Recommended: " in text


def test_ls_on_a_terminal_is_a_table_and_piped_is_columns(terminal, capsys) -> None:
    ls_command.print_models(MODELS, json_out=False)
    assert ANSI in terminal.getvalue()
    text = ANSI_CODE.sub("", terminal.getvalue())
    assert "┃" in text
    assert any("Qwen3.5-4B-4bit" in line and "2.8 GB" in line for line in text.splitlines())
    assert ls_command.render_text(MODELS).splitlines()[2].split() == [
        "someone/other-model",
        "-",
        "12.0",
        "MB",
    ]


def test_json_on_both_parses() -> None:
    runner = CliRunner()
    doctor = json.loads(runner.invoke(app, ["doctor", "--json"], catch_exceptions=False).stdout)
    assert "available_now_bytes" in doctor["hardware"] and doctor["models"]
    assert json.loads(runner.invoke(app, ["ls", "--json"], catch_exceptions=False).stdout) == []


def test_ls_json_lists_each_model(capsys) -> None:
    ls_command.print_models(MODELS, json_out=True)
    listed = json.loads(capsys.readouterr().out)
    assert [m["repo_id"] for m in listed] == [m.repo_id for m in MODELS]
    assert listed[0]["size_bytes"] == 2_800_000_000
