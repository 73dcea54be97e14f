"""A download started from the home screen goes through the real `kapitsa.hub` to a hub on 127.0.0.1."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from huggingface_hub import constants
from tui_support import FakeServices, of_type, settle

from kapitsa.tui.app import KapitsaApp
from kapitsa.tui.messages import DownloadFinished, DownloadProgressed
from kapitsa.tui.services import TuiServices
from kapitsa.tui.widgets.model_table import ModelTable

sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))
from fake_hub import FakeHub, FakeRepo  # noqa: E402  (tests/unit/fake_hub.py)

REPO = "test-org/Tiny-Model-4bit"
WEIGHTS = bytes(range(256)) * 800  # 200 KiB
TINY_ENTRY = {
    "name": "Tiny",
    "model_type": "qwen3_5",
    "params_b": 0.0001,
    "active_params_b": 0.0001,
    "context_length": 4096,
    "max_output": 1024,
    "hidden_size": 64,
    "vocab_size": 256,
    "attention_layers": 1,
    "num_kv_heads": 1,
    "head_dim": 16,
    "quants": {"4bit": REPO},
}


class HubServices(FakeServices):
    download = TuiServices.download  # the real one, over kapitsa.hub


@pytest.fixture
def fake_hub(monkeypatch: pytest.MonkeyPatch):
    fake = FakeHub(
        repos={REPO: FakeRepo({"config.json": b'{"model_type": "qwen3_5"}', "model.safetensors": WEIGHTS})}
    )
    monkeypatch.setenv("HF_ENDPOINT", fake.start())
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    yield fake
    fake.stop()


async def test_d_downloads_with_progress_and_marks_the_row(fake_hub, tmp_path: Path, messages) -> None:
    services = HubServices(tmp_path)
    services.settings.catalog = {"tiny": TINY_ENTRY}
    services.settings.default_model = "tiny"
    app = KapitsaApp(services)
    async with app.run_test(size=(80, 24), message_hook=messages.append) as pilot:
        await settle(pilot)
        table = app.screen.query_one(ModelTable)
        assert table.selected_ref == "tiny" and table.get_row("tiny")[4] == "-"
        await pilot.press("d")
        await settle(pilot)
        (finished,) = of_type(messages, DownloadFinished)
        assert (finished.path / "model.safetensors").read_bytes() == WEIGHTS
        last = of_type(messages, DownloadProgressed)[-1]
        assert last.bytes_done == last.bytes_total == len(WEIGHTS) + len(b'{"model_type": "qwen3_5"}')
        assert table.get_row("tiny")[4] == "yes"
    async with KapitsaApp(services).run_test(size=(80, 24)) as pilot:  # a new session sees it in the HF cache
        await settle(pilot)
        assert pilot.app.screen.query_one(ModelTable).get_row("tiny")[4] == "yes"
