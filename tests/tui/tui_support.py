"""Test doubles and helpers for the TUI tests."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

from textual.message import Message

from kapitsa.doctor import RECORDED_PROFILES
from kapitsa.engine.types import EngineStats, ModelInfo
from kapitsa.testing.fake_engine import FakeEngine
from kapitsa.tui.services import DownloadCancelledError, TuiServices

BUSY_STATS = EngineStats(
    model="4b",
    prefill_tok_s=812.5,
    decode_tok_s=42.25,
    active_requests=2,
    queued_requests=1,
    batch_size=2,
    prompt_tokens_cached=7500,
    prompt_tokens_computed=2500,
    generated_tokens=1234,
    checkpoints_in_memory=3,
    checkpoint_bytes_in_memory=48 * 2**20,
    checkpoints_on_disk=5,
    checkpoint_bytes_on_disk=80 * 2**20,
    conversations_in_memory=5,
    resident_conversations=3,
    resident_bytes=40 * 2**20,
    memory_in_use_bytes=3 * 2**30,
    memory_peak_bytes=4 * 2**30,
    memory_limit_bytes=36 * 2**30,
    speculative="ngram",
    draft_acceptance_rate=0.625,
    tokens_per_step=1.8,
    requests_finished=17,
    requests_failed=1,
)


class BusyFakeEngine(FakeEngine):
    """A FakeEngine whose stats look like an engine under load (the live panels need numbers)."""

    def stats(self) -> EngineStats:
        return replace(BUSY_STATS, active_requests=len(self._active) + 2)


class FakeServices(TuiServices):
    """Real doctor (recorded 48 GB Mac), real server over a FakeEngine; scripted downloads and agents."""

    def __init__(self, tmp_path: Path, *, engine_factory: Callable | None = None) -> None:
        settings = SimpleNamespace(
            default_model="4b",
            catalog={},
            num_checkpoints=4,
            host="127.0.0.1",
            port=_free_port(),
            state_dir=tmp_path / "state",
            server_start_timeout_s=5.0,
        )
        super().__init__(
            engine_factory=engine_factory
            or (lambda ref: BusyFakeEngine(model=ModelInfo(ref, "fake", 32768, 8192))),
            hardware=RECORDED_PROFILES["m4-pro-48gb"],
            settings=settings,
        )
        self.download_steps = 5
        self.download_step_s = 0.0
        self.agent_runs: list[tuple[list[str], dict[str, str]]] = []

    def download(self, ref, *, on_progress, cancelled: threading.Event) -> Path:
        total = 1000 * self.download_steps
        for step in range(1, self.download_steps + 1):
            if cancelled.is_set():
                raise DownloadCancelledError(ref)
            time.sleep(self.download_step_s)
            on_progress(step * 1000, total)
        return Path("/models") / ref

    def agent_invocation(self, agent, handle):
        return [f"fake-{agent}", "--model", handle.model], {"FAKE_URL": handle.url}

    def run_agent(self, argv, env) -> int:
        self.agent_runs.append((argv, env))
        return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def of_type(messages: list[Message], kind: type) -> list:
    return [m for m in messages if isinstance(m, kind)]


async def settle(pilot) -> None:
    """Wait for every worker but the stats poller to finish and the messages they posted to be handled."""
    workers = [w for w in pilot.app.workers if w.group != "stats"]
    await asyncio.gather(*(w.wait() for w in workers), return_exceptions=True)  # cancelled ones raise
    await pilot.pause()
    await pilot.pause()


async def wait_until(pilot, condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """For long-running workers (the stats poller): pause until `condition` holds."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await pilot.pause(0.05)
