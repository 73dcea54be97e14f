"""The TUI's one adapter to the rest of kapitsa: doctor, catalog, downloads, engine + server, agents.

Each piece is imported where it is used. A piece missing from this build raises `Unavailable`,
which the screens show as text; nothing here invents data to fill the gap.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kapitsa.engine.client import EngineClient
from kapitsa.errors import KapitsaError, NotDownloaded
from kapitsa.private_files import make_private_dir

# Agent command name → what the launch screen calls it.
AGENT_LABELS: dict[str, str] = {"opencode": "opencode", "claude": "Claude Code", "codex": "Codex", "pi": "pi"}

EngineFactory = Callable[[str], EngineClient]


class Unavailable(KapitsaError):
    """A part of kapitsa that this screen needs is not in this build."""


class DownloadCancelledError(Exception):
    """Raised from the progress callback to stop a download; the partial file stays for resuming."""


@contextlib.contextmanager
def needs(what: str) -> Iterator[None]:
    """Around an import only: a piece missing from this build becomes `Unavailable`, naming `what`."""
    try:
        yield
    except ImportError as err:
        raise Unavailable(f"{what} is not available in this build ({err})") from err


@dataclass(slots=True)
class EngineHandle:
    """A running engine and the HTTP server over it on 127.0.0.1."""

    model: str
    client: EngineClient
    url: str  # http://127.0.0.1:PORT, no /v1
    api_key: str | None = None  # the server's token (KAPITSA_API_KEY), when one is set
    server: Any = None  # uvicorn.Server
    thread: threading.Thread | None = None
    state_dir: Path | None = None  # where server.json records the port (`kapitsa env` reads it)
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
        if self.state_dir is not None:
            from kapitsa.server_state import forget_server

            forget_server(self.state_dir)
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
            with needs("settings"):
                from kapitsa.settings import load_settings
            self._settings = load_settings()
        return self._settings

    def catalog(self) -> Any:
        with needs("the model catalog"):
            from kapitsa.catalog import load_catalog
        return load_catalog(self.settings.catalog)

    def doctor_report(self) -> Any:
        with needs("doctor"):
            from kapitsa.doctor import build_report
        return build_report(self.hardware(), self.catalog(), num_checkpoints=self.settings.num_checkpoints)

    def hardware(self) -> Any:
        """The hardware profile given to the services, else this machine's, probed now."""
        if self._hardware is not None:
            return self._hardware
        with needs("doctor"):
            from kapitsa.doctor import probe_hardware
        return probe_hardware()

    def downloaded_refs(self, report: Any) -> frozenset[str]:
        """Refs whose weights are on this machine: in the HF cache, or shipped inside kapitsa (the demo)."""
        with needs("downloads"):
            from kapitsa import hub
        cached = {m.repo_id for m in hub.list_local(catalog=self.catalog())}
        return frozenset(
            f.ref
            for f in report.models
            if f.repo_id in cached or (f.repo_id is None and f.verdict != "unavailable")
        )

    def download(
        self, ref: str, *, on_progress: Callable[[int, int], None], cancelled: threading.Event
    ) -> Path:
        with needs("downloads"):
            from kapitsa import hub

        def report(progress: Any) -> None:
            if cancelled.is_set():
                raise DownloadCancelledError(ref)
            on_progress(progress.bytes_done, progress.bytes_total)

        return hub.pull(ref, catalog=self.catalog(), on_progress=report).path

    def start_engine(self, ref: str) -> EngineHandle:
        """Load `ref` in an engine thread and serve it on 127.0.0.1 (blocking: call from a worker)."""
        with needs("the HTTP server"):
            from kapitsa.server.runner import bound_port, make_server
            from kapitsa.server.settings import ServerSettings
        try:
            client = self._engine_factory(ref)
        except NotDownloaded as err:  # the CLI's `kapitsa pull` hint, in the TUI's own terms
            raise NotDownloaded(f"{ref} is not downloaded yet: press d to download it", ref=err.ref) from None
        sock = None
        try:
            sock = _reserve_free_port(self.settings.port)
            settings = ServerSettings(host="127.0.0.1", port=bound_port(sock), model=ref)
            server, thread = _serve_in_thread(
                make_server(client, settings),
                sock,
                log_dir=Path(self.settings.state_dir) / "logs",
            )
        except BaseException:
            if sock is not None:
                sock.close()
            EngineHandle(ref, client, "").stop()
            raise
        from kapitsa.server_state import record_server

        state_dir = Path(self.settings.state_dir)
        record_server(state_dir, host=settings.host, port=settings.port)
        return EngineHandle(
            ref, client, f"http://127.0.0.1:{settings.port}", settings.api_key, server, thread, state_dir
        )

    def env_lines(self, handle: EngineHandle) -> list[str]:
        """Export lines (in the user's shell's syntax) pointing SDKs and IDEs at the running server."""
        with needs("`kapitsa env`"):
            from kapitsa.shell_env import env_lines
        return list(env_lines(handle.url, handle.api_key).lines)

    def agent_invocation(self, agent: str, handle: EngineHandle) -> tuple[list[str], dict[str, str]]:
        """The argv and environment that start `agent` against the running server (which it reuses)."""
        with needs("the agent launchers"):
            from kapitsa.agents.launch import prepare_launch
        plan = prepare_launch(agent, handle.model, [], settings=self.settings, api_key=handle.api_key)
        return list(plan.command), dict(plan.env)

    def agents_the_window_cannot_hold(self, handle: EngineHandle) -> frozenset[str]:
        """The agents whose first request the running model's window cannot hold."""
        try:
            with needs("the agent launchers"):
                from kapitsa.agents.window import window_shortfall
        except Unavailable:
            return frozenset()
        served = handle.client.models()[0].context_length
        return frozenset(a for a in AGENT_LABELS if window_shortfall(a, handle.model, served))

    def window_shortfall(self, agent: str, handle: EngineHandle) -> str | None:
        """Why `agent` would only get 400s from the running model (its window cannot hold the agent's first
        request), naming a catalog model that can; None when the window holds it."""
        with needs("the agent launchers"):
            from kapitsa.agents.window import suggest_model, window_shortfall
        served = handle.client.models()[0].context_length
        shortfall = window_shortfall(agent, handle.model, served)
        if shortfall is None:
            return None
        alias = suggest_model(
            self.catalog(),
            agent,
            exclude=handle.model.split(":")[0],
            usable_bytes=self.hardware().usable_memory_bytes,
            num_checkpoints=self.settings.num_checkpoints,
        )
        if alias is None:
            return f"{shortfall}; no catalog model holds it on this machine"
        return f"{shortfall}; stop the engine (s), then select {alias}, download it (d) and start it (s)"

    def run_agent(self, argv: list[str], env: dict[str, str]) -> int:
        """Run the agent in this terminal until it exits (the TUI is suspended around this)."""
        try:
            return subprocess.run(argv, env={**os.environ, **env}, check=False).returncode
        except FileNotFoundError as err:
            raise KapitsaError(f"{argv[0]} is not installed or not on PATH") from err


def _default_engine_factory(ref: str) -> EngineClient:
    """The engine `kapitsa serve` runs (the same opener, its batch sizes and prefill lengths
    readied while idle for the agents it serves): alias, folder, .gguf or cached repo id."""
    from kapitsa.opener import open_engine

    return open_engine(ref, warm_batches=True)


def _reserve_free_port(preferred: int, tries: int = 20) -> socket.socket:
    """The first free port from `preferred` on, bound (the server then serves that very socket)."""
    from kapitsa.server.runner import reserve_port

    for port in range(preferred, preferred + tries):
        with contextlib.suppress(KapitsaError):
            return reserve_port("127.0.0.1", port)
    raise KapitsaError(f"ports {preferred}-{preferred + tries - 1} on 127.0.0.1 are all taken")


def _serve_in_thread(
    server: Any, sock: socket.socket, *, log_dir: Path, timeout_s: float = 30.0
) -> tuple[Any, threading.Thread]:
    _log_server_to_file(log_dir / "tui-server.log")
    port = sock.getsockname()[1]
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="kapitsa-server", daemon=True
    )
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


def _log_server_to_file(path: Path) -> None:
    """Server warnings go to a file: the terminal belongs to the TUI."""
    make_private_dir(path.parent)  # owner only, like the rest of the state
    logger = logging.getLogger("uvicorn.error")
    if not any(getattr(h, "baseFilename", None) == str(path) for h in logger.handlers):
        logger.addHandler(logging.FileHandler(path))
