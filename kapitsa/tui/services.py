"""The TUI's one adapter to the rest of kapitsa: doctor, catalog, downloads, engine + server, agents.

Each piece is imported where it is used. A piece missing from this build raises `Unavailable`,
which the screens show as text; nothing here invents data to fill the gap.
"""

from __future__ import annotations

import importlib
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from kapitsa.engine.client import EngineClient
from kapitsa.errors import KapitsaError

# Agent command name → what the launch screen calls it.
AGENT_LABELS: dict[str, str] = {"opencode": "opencode", "claude": "Claude Code", "codex": "Codex", "pi": "pi"}

EngineFactory = Callable[[str], EngineClient]


class Unavailable(KapitsaError):
    """A part of kapitsa that this screen needs is not in this build."""


class DownloadCancelledError(Exception):
    """Raised from the progress callback to stop a download; the partial file stays for resuming."""


def _require(module: str, what: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise Unavailable(f"{what} is not available in this build ({module}: {err})") from err


@dataclass(slots=True)
class EngineHandle:
    """A running engine and the HTTP server over it on 127.0.0.1."""

    model: str
    client: EngineClient
    url: str  # http://127.0.0.1:PORT, no /v1
    server: Any = None  # uvicorn.Server
    thread: threading.Thread | None = None
    _stopped: bool = field(default=False, repr=False)

    def stop(self) -> None:
        """Stop the server, then the engine. Safe to call twice."""
        if self._stopped:
            return
        self._stopped = True
        if self.server is not None:
            self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout=30)
        close = getattr(self.client, "close", None)
        if callable(close):
            close()


class TuiServices:
    """Everything the screens do outside the UI. Tests pass their own engine factory and hardware."""

    def __init__(
        self, *, engine_factory: EngineFactory | None = None, hardware: Any = None, settings: Any = None
    ) -> None:
        self._engine_factory = engine_factory or _default_engine_factory
        self._hardware = hardware  # a doctor.HardwareProfile; None = probe this machine
        self._settings = settings

    @property
    def settings(self) -> Any:
        if self._settings is None:
            self._settings = _require("kapitsa.settings", "settings").load_settings()
        return self._settings

    def catalog(self) -> Any:
        return _require("kapitsa.catalog", "the model catalog").load_catalog(self.settings.catalog)

    def doctor_report(self) -> Any:
        doctor = _require("kapitsa.doctor", "doctor")
        hardware = self._hardware or doctor.probe_hardware()
        return doctor.build_report(hardware, self.catalog(), num_checkpoints=self.settings.num_checkpoints)

    def downloaded_refs(self, report: Any) -> frozenset[str]:
        """Refs whose weights are on this machine: in the HF cache, or shipped inside kapitsa (the demo)."""
        hub = _require("kapitsa.hub", "downloads")
        cached = {m.repo_id for m in hub.list_local(catalog=self.catalog())}
        return frozenset(
            f.ref
            for f in report.models
            if f.repo_id in cached or (f.repo_id is None and f.verdict != "unavailable")
        )

    def download(
        self, ref: str, *, on_progress: Callable[[int, int], None], cancelled: threading.Event
    ) -> Path:
        hub = _require("kapitsa.hub", "downloads")

        def report(progress: Any) -> None:
            if cancelled.is_set():
                raise DownloadCancelledError(ref)
            on_progress(progress.bytes_done, progress.bytes_total)

        return hub.pull(ref, catalog=self.catalog(), on_progress=report).path

    def start_engine(self, ref: str) -> EngineHandle:
        """Load `ref` in an engine thread and serve it on 127.0.0.1 (blocking: call from a worker)."""
        create_app = _require("kapitsa.server.app", "the HTTP server").create_app
        server_settings = _require("kapitsa.server.settings", "the HTTP server").ServerSettings
        client = self._engine_factory(ref)
        try:
            port = _free_port(self.settings.port)
            app = create_app(client, server_settings(host="127.0.0.1", port=port, model=ref))
            server, thread = _serve_in_thread(app, port, log_dir=Path(self.settings.state_dir))
        except BaseException:
            EngineHandle(ref, client, "").stop()
            raise
        return EngineHandle(ref, client, f"http://127.0.0.1:{port}", server, thread)

    def env_lines(self, url: str) -> list[str]:
        """Export lines for shells and IDEs pointing at `url`."""
        env_cmd = _require("kapitsa.env_cmd", "`kapitsa env`")
        return list(env_cmd.export_lines(url))

    def agent_invocation(self, agent: str, handle: EngineHandle) -> tuple[list[str], dict[str, str]]:
        """The argv and environment that start `agent` against the running server."""
        module = _require(f"kapitsa.agents.{agent}", f"the {AGENT_LABELS.get(agent, agent)} launcher")
        env = module.build_env(f"{handle.url}", handle.model)
        return list(module.build_command([])), dict(env)

    def run_agent(self, argv: list[str], env: dict[str, str]) -> int:
        """Run the agent in this terminal until it exits (the TUI is suspended around this)."""
        try:
            return subprocess.run(argv, env={**os.environ, **env}, check=False).returncode
        except FileNotFoundError as err:
            raise KapitsaError(f"{argv[0]} is not installed or not on PATH") from err


def _default_engine_factory(ref: str) -> EngineClient:
    inprocess = _require("kapitsa.engine.inprocess", "the in-process engine")
    return inprocess.open_engine(ref)


def _free_port(preferred: int, tries: int = 20) -> int:
    for port in range(preferred, preferred + tries):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise KapitsaError(f"ports {preferred}-{preferred + tries - 1} on 127.0.0.1 are all taken")


def _serve_in_thread(
    app: Any, port: int, *, log_dir: Path, timeout_s: float = 30.0
) -> tuple[Any, threading.Thread]:
    import uvicorn

    log_dir.mkdir(parents=True, exist_ok=True)
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, access_log=False, log_config=_log_config(log_dir)
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="kapitsa-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise KapitsaError(
                f"the server did not start on 127.0.0.1:{port}; see {log_dir / 'tui-server.log'}"
            )
        time.sleep(0.05)
    return server, thread


def _log_config(log_dir: Path) -> dict[str, Any]:
    """Server logs go to a file: the terminal belongs to the TUI."""
    handler = {"class": "logging.FileHandler", "filename": str(log_dir / "tui-server.log"), "level": "INFO"}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "handlers": {"file": handler},
        "loggers": {
            name: {"handlers": ["file"], "level": "INFO", "propagate": False}
            for name in ("uvicorn", "uvicorn.error", "uvicorn.access")
        },
    }
