from __future__ import annotations

import subprocess
import sys

from typer.testing import CliRunner

from kapitsa import __version__
from kapitsa.cli import app

RESERVED = [
    "run",
    "serve",
    "doctor",
    "pull",
    "ls",
    "rm",
    "bench",
    "env",
    "token",
    "claude",
    "codex",
    "opencode",
    "pi",
]


def test_help_lists_every_command() -> None:
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    for name in RESERVED:
        assert f"  {name} " in result.output, name


def test_version() -> None:
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.output.strip() == f"kapitsa {__version__}"


def test_python_dash_m_and_clean_error() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kapitsa", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == f"kapitsa {__version__}"


def test_help_does_not_import_heavy_modules() -> None:
    code = (
        "import sys; from typer.testing import CliRunner; from kapitsa.cli import app; "
        "CliRunner().invoke(app, ['--help']); "
        "print(sorted(m for m in ('mlx', 'textual', 'fastapi', 'uvicorn', 'kapitsa.engine') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
