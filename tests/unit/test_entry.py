"""The console script answers --version without importing the CLI framework, and hands the rest to the CLI."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

from kapitsa import __version__

ROOT = Path(__file__).resolve().parents[2]


def _run_entry(*args: str) -> subprocess.CompletedProcess[str]:
    code = (
        "import sys; from kapitsa._entry import main; main(); "
        "print(sorted(m for m in ('typer', 'click', 'kapitsa.cli') if m in sys.modules))"
    )
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)


def test_version_skips_the_cli_framework() -> None:
    out = _run_entry("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [f"kapitsa {__version__}", "[]"]


def test_everything_else_goes_to_the_cli() -> None:
    out = _run_entry("--help")
    assert out.returncode == 0, out.stderr
    assert "Usage: " in out.stdout and "  serve " in out.stdout and "  claude " in out.stdout
    out = _run_entry("--version", "--debug")  # not the bare fast path: the CLI's own --version answers
    assert out.stdout.splitlines()[0] == f"kapitsa {__version__}"


def test_console_script_is_the_fast_entry() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"kapitsa": "kapitsa._entry:main"}
