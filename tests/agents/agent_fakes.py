"""Helpers for launcher tests (a unique module name: `conftest` is ambiguous across test folders)."""

from __future__ import annotations

import json
from pathlib import Path


def run_recorded(command: list[str], env: dict[str, str]) -> dict:
    import subprocess

    subprocess.run(command, env=env, check=True, timeout=30)
    return json.loads(Path(env["FAKE_AGENT_RECORD"]).read_text())
