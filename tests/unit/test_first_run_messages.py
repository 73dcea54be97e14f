"""A model that is not downloaded says how to get it with kapitsa itself, never with another tool."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kapitsa.errors import NotDownloaded
from kapitsa.opener import load_for_ref

PACKAGE = Path(__file__).resolve().parents[2] / "kapitsa"
OTHER_TOOLS = re.compile(r"hf download|huggingface-cli")


@pytest.fixture
def empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KAPITSA_CONFIG", str(tmp_path / "no-config.toml"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    (tmp_path / "hub").mkdir()
    return tmp_path


@pytest.mark.parametrize("spec", ["4b", "4b:8bit"])
def test_a_catalog_model_not_downloaded_says_kapitsa_pull(empty_cache: Path, spec: str) -> None:
    with pytest.raises(NotDownloaded) as err:
        load_for_ref(spec)
    assert f"run `kapitsa pull {spec}`" in str(err.value) and err.value.ref == spec
    assert not OTHER_TOOLS.search(str(err.value))


def test_a_repo_id_not_downloaded_says_kapitsa_pull(empty_cache: Path) -> None:
    with pytest.raises(NotDownloaded, match="`kapitsa pull org/missing`"):
        load_for_ref("org/missing")


def test_kapitsa_run_prints_the_hint_and_fails(empty_cache: Path) -> None:
    import os

    env = {
        **os.environ,
        "KAPITSA_CONFIG": str(empty_cache / "no-config.toml"),
        "HF_HUB_CACHE": str(empty_cache / "hub"),
    }
    out = subprocess.run(
        [sys.executable, "-m", "kapitsa", "run", "--model", "4b", "hi"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert out.returncode == 1
    assert "kapitsa pull 4b" in out.stderr and not OTHER_TOOLS.search(out.stderr)


def test_no_message_in_the_package_names_another_download_tool() -> None:
    offenders = [
        f"{path.relative_to(PACKAGE)}:{n}"
        for path in PACKAGE.rglob("*.py")
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if OTHER_TOOLS.search(line)
    ]
    assert offenders == []
