"""The import-linter contracts have teeth: an engine module that imports a framework breaks the first,
a surface (server, TUI, bench, agents, CLI commands) that reaches past the engine's client, types,
options and the opener breaks the second.

lint-imports runs on a temporary copy of the package with one offending module added, under the
project's own contracts (pyproject.toml), so the real tree is never touched.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = "_contract_probe"
# `python -m importlinter.cli` silently does nothing (the module has no __main__ guard); call the command.
LINT_IMPORTS = (
    "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
)


def _lint_imports(cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", LINT_IMPORTS, "--no-cache"],  # reads ./pyproject.toml
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
    )


def _lint_copy(
    tmp_path: Path, probe_source: str | None, package: str = "engine"
) -> subprocess.CompletedProcess[str]:
    shutil.copytree(
        ROOT / "kapitsa", tmp_path / "kapitsa", ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
    )
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    if probe_source is not None:
        (tmp_path / "kapitsa" / package / f"{PROBE}.py").write_text(probe_source)
    # PYTHONPATH puts the copy ahead of the editable install of the real tree.
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    return _lint_imports(tmp_path, env)


@pytest.mark.parametrize(
    ("source", "forbidden"),
    [
        ("import fastapi\n", "fastapi"),
        ("from starlette.responses import JSONResponse\n", "starlette"),
        ("def later():\n    from kapitsa.tui import app\n", "kapitsa.tui.app"),
    ],
)
def test_contract_breaks_when_the_engine_imports_a_framework(
    tmp_path: Path, source: str, forbidden: str
) -> None:
    result = _lint_copy(tmp_path, source)
    assert result.returncode != 0
    assert "BROKEN" in result.stdout
    assert f"kapitsa.engine.{PROBE} -> {forbidden}" in result.stdout, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("package", "source", "forbidden"),
    [
        ("server", "from kapitsa.engine.text.token_checks import check_token_ids\n", "kapitsa.engine.text"),
        ("tui", "def later():\n    from kapitsa.engine.inprocess import InProcessEngine\n", "kapitsa.engine"),
        ("bench", "import kapitsa.engine.runner.loop\n", "kapitsa.engine.runner.loop"),
        ("commands", "from kapitsa.engine.loading.loader import load_model\n", "kapitsa.engine.loading"),
    ],
)
def test_contract_breaks_when_a_surface_reaches_into_the_engine(
    tmp_path: Path, package: str, source: str, forbidden: str
) -> None:
    result = _lint_copy(tmp_path, source, package)
    assert result.returncode != 0
    assert (
        "Surfaces reach the engine through its client, types, options and the opener BROKEN" in result.stdout
    )
    assert f"kapitsa.{package}.{PROBE} -> {forbidden}" in result.stdout, result.stdout + result.stderr


def test_the_surface_contract_names_every_private_part_of_the_engine() -> None:
    """A new engine sub-package or module is forbidden to the surfaces unless it is made public here."""
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (surfaces,) = [c for c in contracts if c["name"].startswith("Surfaces reach the engine")]
    public = {"__init__", "client", "types", "options"}
    engine = ROOT / "kapitsa" / "engine"
    parts = {p.stem for p in engine.glob("*.py")} | {
        p.name for p in engine.iterdir() if (p / "__init__.py").exists()
    }
    assert {f"kapitsa.engine.{name}" for name in parts - public} == set(surfaces["forbidden_modules"])


def test_unchanged_copy_keeps_the_contract(tmp_path: Path) -> None:
    result = _lint_copy(tmp_path, None)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "KEPT" in result.stdout


def test_the_real_tree_keeps_the_contract() -> None:
    result = _lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 2 kept, 0 broken." in result.stdout
