from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from textual.message import Message
from tui_support import FakeServices

from kapitsa.tui.app import KapitsaApp


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants
    from huggingface_hub.utils import _cache_manager

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))  # nothing downloaded
    # huggingface_hub reads the variable at import time, and scan_cache_dir keeps its own copy.
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(_cache_manager, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("KAPITSA_BENCH_DIR", str(tmp_path / "bench"))
    monkeypatch.delenv("KAPITSA_BENCH_RESULTS_URL", raising=False)


@pytest.fixture
def services(tmp_path: Path) -> FakeServices:
    return FakeServices(tmp_path)


@pytest.fixture
def make_app(services: FakeServices) -> Callable[[], KapitsaApp]:
    return lambda: KapitsaApp(services)


@pytest.fixture
def messages() -> list[Message]:
    return []
