"""A failed download stops its bar and says why on its row (and in the error modal)."""

from __future__ import annotations

import pytest
from textual.widgets import Label, ProgressBar
from tui_support import FakeServices, of_type, settle

from kapitsa.errors import KapitsaError
from kapitsa.tui.app import KapitsaApp
from kapitsa.tui.messages import DownloadFailed
from kapitsa.tui.screens.error import ErrorModal
from kapitsa.tui.widgets.downloads_panel import DownloadsPanel

REASON = (
    "HTTP 503 Service Unavailable while downloading mlx-community/Qwen3.5-4B-4bit from https://huggingface.co"
)


class FailingDownloads(FakeServices):
    def __init__(self, tmp_path, *, fail_after_bytes: int | None) -> None:
        super().__init__(tmp_path)
        self.fail_after_bytes = fail_after_bytes

    def download(self, ref, *, on_progress, cancelled):
        if self.fail_after_bytes is not None:
            on_progress(self.fail_after_bytes, 4000)
        raise KapitsaError(f"{REASON}.\nRun the pull again to resume")


@pytest.mark.parametrize("fail_after_bytes", [None, 1000], ids=["before-any-byte", "midway"])
async def test_a_failed_download_stops_its_bar_and_shows_the_error(
    tmp_path, messages, fail_after_bytes
) -> None:
    app = KapitsaApp(FailingDownloads(tmp_path, fail_after_bytes=fail_after_bytes))
    async with app.run_test(size=(120, 30), message_hook=messages.append) as pilot:
        await settle(pilot)
        home = app.screen
        await pilot.press("d")
        await settle(pilot)
        assert of_type(messages, DownloadFailed)
        assert isinstance(app.screen, ErrorModal)
        row = home.query_one(DownloadsPanel).query_one(".dl-row")
        bar = row.query_one(ProgressBar)
        assert bar.total is not None and bar.percentage is not None  # not indeterminate: nothing animates
        assert bar.progress == (fail_after_bytes or 0)
        assert row.has_class("dl-failed")
        status = str(row.query_one(".dl-status", Label).render())
        assert status == f"failed: {REASON}."  # the first line only: a row is one line
        assert "4b" not in home.cancel_events  # d starts it again
