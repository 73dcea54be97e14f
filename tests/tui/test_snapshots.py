"""Snapshots of every screen at 80x24 (the smallest supported terminal) and 160x48 (a roomy one).

Review a changed SVG, then `pytest --snapshot-update`."""

from __future__ import annotations

from pathlib import Path

import pytest
from tui_support import BUSY_STATS, FakeServices, settle

from kapitsa.bench.schema import BenchReport, EngineResult, WorkloadResult
from kapitsa.doctor import RECORDED_PROFILES, DoctorReport, ModelFit
from kapitsa.errors import KapitsaError
from kapitsa.tui.app import KapitsaApp
from kapitsa.tui.messages import BenchFinished

SIZES = {"80x24": (80, 24), "160x48": (160, 48)}
FITS = (
    ModelFit("demo", "demo", "kapitsa demo", None, None, 12_000_000, 32768, "fits"),
    ModelFit(
        "4b", "4b", "Qwen3.5 4B", "4bit", "mlx-community/Qwen3.5-4B-4bit", 2_800_000_000, 262144, "fits"
    ),
    ModelFit(
        "27b", "27b", "Qwen3.6 27B", "4bit", "mlx-community/Qwen3.6-27B-4bit", 15_400_000_000, 262144, "fits"
    ),
    ModelFit(
        "27b:8bit",
        "27b",
        "Qwen3.6 27B",
        "8bit",
        "mlx-community/Qwen3.6-27B-8bit",
        29_000_000_000,
        49152,
        "tight",
    ),
    ModelFit(
        "bolt", "bolt", "Nemotron Bolt", "4bit", "nvidia/bolt", 70_000_000_000, 0, "too_big", estimated=True
    ),
)
REPORT = DoctorReport(RECORDED_PROFILES["m4-pro-48gb"], FITS, recommended="27b")


class SnapshotServices(FakeServices):
    """A fixed doctor report, so snapshots do not change when the catalog does."""

    def doctor_report(self):
        return REPORT

    def downloaded_refs(self, report):
        return frozenset({"demo", "4b"})


@pytest.fixture
def app(tmp_path: Path) -> KapitsaApp:
    return KapitsaApp(SnapshotServices(tmp_path))


@pytest.fixture(params=list(SIZES.values()), ids=list(SIZES))
def size(request: pytest.FixtureRequest) -> tuple[int, int]:
    return request.param


def _bench_report() -> BenchReport:
    metrics = {
        "decode_short": {"decode_tok_s": 41.8, "ttft_s": 0.21},
        "decode_long": {"decode_tok_s": 38.2, "ttft_s": 2.4},
        "prefill": {"prefill_tok_s": 1210.5},
        "ttft_cold_warm": {"ttft_cold_s": 2.61, "ttft_warm_s": 0.094},
        "agent_replay": {"cache_hit_pct": 91.3},
        "concurrent_4": {"aggregate_tok_s": 102.7},
    }
    workloads = [WorkloadResult(name, metrics=m) for name, m in metrics.items()]
    workloads.append(WorkloadResult("speculative", status="skipped", note="speculative decoding is off"))
    engine = EngineResult("kapitsa", "http", "27b", url="http://127.0.0.1:8484/v1", workloads=workloads)
    return BenchReport(machine={}, config={}, engines=[engine])


def test_home(snap_compare, app, size) -> None:
    assert snap_compare(app, terminal_size=size, run_before=settle)


def test_live_panels(snap_compare, app, size) -> None:
    async def feed_stats(pilot) -> None:
        await settle(pilot)
        await pilot.press("2")
        for scale in (0.2, 0.5, 0.9, 1.0, 0.7, 1.0):
            pilot.app.engine_stats = BUSY_STATS.__class__(
                **{
                    **{f: getattr(BUSY_STATS, f) for f in BUSY_STATS.__slots__},
                    "decode_tok_s": BUSY_STATS.decode_tok_s * scale,
                    "prefill_tok_s": BUSY_STATS.prefill_tok_s * scale,
                }
            )
            await pilot.pause()

    assert snap_compare(app, terminal_size=size, run_before=feed_stats)


def test_bench_results(snap_compare, app, size) -> None:
    async def show_results(pilot) -> None:
        await settle(pilot)
        await pilot.press("3")
        pilot.app.screen.post_message(BenchFinished(_bench_report(), Path("/tmp/bench-example.json")))
        await pilot.pause()

    assert snap_compare(app, terminal_size=size, run_before=show_results)


@pytest.mark.parametrize("keys", [["question_mark"], ["a"], ["3", "r"]], ids=["help", "launch", "error"])
def test_modals(snap_compare, app, size, keys: list[str]) -> None:
    async def open_modal(pilot) -> None:
        await settle(pilot)
        await pilot.press(*keys)
        await pilot.pause()

    assert snap_compare(app, terminal_size=size, run_before=open_modal)


def test_failed_download(snap_compare, tmp_path: Path, size) -> None:
    """The row of a failed download: its bar stopped, the error's first line beside it."""

    class FailingDownload(SnapshotServices):
        def download(self, ref, *, on_progress, cancelled):
            on_progress(1_200_000_000, 2_800_000_000)
            raise KapitsaError(
                "HTTP 503 Service Unavailable while downloading mlx-community/Qwen3.6-27B-4bit from "
                "https://huggingface.co. Run the pull again to resume; set HF_ENDPOINT for a mirror"
            )

    async def fail_a_download(pilot) -> None:
        await settle(pilot)
        await pilot.press("down", "d")  # from 4b (the default) to 27b, not on disk
        await settle(pilot)
        await pilot.press("escape")  # the error modal; the row stays
        await pilot.pause()

    assert snap_compare(KapitsaApp(FailingDownload(tmp_path)), terminal_size=size, run_before=fail_a_download)
