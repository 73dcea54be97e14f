"""First run in the TUI: starting a catalog model that is not downloaded says to press d, in one modal."""

from __future__ import annotations

from pathlib import Path

import pytest
from tui_support import FakeServices, of_type, settle

from kapitsa.tui.app import KapitsaApp
from kapitsa.tui.messages import EngineFailed
from kapitsa.tui.screens.error import ErrorModal
from kapitsa.tui.services import _default_engine_factory


async def test_starting_a_model_that_is_not_downloaded_says_press_d(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, messages
) -> None:
    monkeypatch.setenv("KAPITSA_CONFIG", str(tmp_path / "no-config.toml"))
    app = KapitsaApp(FakeServices(tmp_path, engine_factory=_default_engine_factory))
    async with app.run_test(size=(80, 24), message_hook=messages.append) as pilot:
        await settle(pilot)
        assert app.selected_ref == "4b"
        await pilot.press("s")
        await settle(pilot)
        assert of_type(messages, EngineFailed) and app.engine_status == "failed"
        assert isinstance(app.screen, ErrorModal)
        assert "4b is not downloaded yet: press d to download it" in app.screen.message
        assert "hf download" not in app.screen.message and "kapitsa pull" not in app.screen.message
