"""The engine must run bare on a GPU machine: importing it loads no UI/web/CLI framework."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

FORBIDDEN = ("textual", "fastapi", "starlette", "uvicorn", "typer", "rich", "pydantic", "pydantic_settings")
ROOT = Path(__file__).resolve().parents[2]


def test_engine_import_loads_no_framework() -> None:
    code = (
        "import sys, pkgutil, importlib, kapitsa.engine as e\n"
        "for m in pkgutil.walk_packages(e.__path__, 'kapitsa.engine.'):\n"
        "    importlib.import_module(m.name)\n"
        f"print(sorted({{n.split('.')[0] for n in sys.modules}} & set({FORBIDDEN!r})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_import_linter_contract_holds() -> None:
    lint_imports = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run(
        [str(lint_imports), str(ROOT / "pyproject.toml")], capture_output=True, text=True, cwd=ROOT
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 kept, 0 broken" in out.stdout, out.stdout  # both contracts really ran
