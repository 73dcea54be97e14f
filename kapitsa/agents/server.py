"""Find a running kapitsa server for a model, or start one in the background and wait for /health."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import httpx

from kapitsa.errors import KapitsaError
from kapitsa.private_files import PRIVATE_FILE, make_private_dir
from kapitsa.server_state import http_url

PORTS_TO_TRY = 20


@dataclass(slots=True, frozen=True)
class ServerProbe:
    state: Literal["free", "server", "busy"]  # nothing listening / an OpenAI-style server / something else
    model_ids: tuple[str, ...] = ()


@dataclass(slots=True, frozen=True)
class ServerHandle:
    base_url: str
    model_id: str  # the id the server lists for the wanted model
    started: bool  # False when an already running server was reused
    pid: int | None = None
    log_path: Path | None = None


def probe(base_url: str, api_key: str | None, timeout: float = 1.0) -> ServerProbe:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        health = httpx.get(f"{base_url}/health", timeout=timeout)
    except httpx.ConnectError:
        return ServerProbe("free")
    except httpx.HTTPError:
        return ServerProbe("busy")
    if health.status_code != 200:
        return ServerProbe("busy")
    try:
        listing = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=timeout).json()
        ids = tuple(str(m["id"]) for m in listing.get("data", []))
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        return ServerProbe("busy")
    return ServerProbe("server", ids)


def matching_id(model_ids: Iterable[str], wanted: Iterable[str]) -> str | None:
    names = [w for w in wanted if w]
    return next((m for m in model_ids if m in names), None)


def ensure_server(
    *,
    model_ref: str,
    wanted_ids: Iterable[str],
    host: str,
    first_port: int,
    api_key: str | None,
    log_dir: Path,
    timeout_s: float,
    environ: Mapping[str, str] | None = None,
    serve_args: tuple[str, ...] = (),
) -> ServerHandle:
    """Reuse a server already serving the model, else start `kapitsa serve` on the first free port."""
    wanted = tuple(wanted_ids)
    for port in range(first_port, first_port + PORTS_TO_TRY):
        base_url = http_url(host, port)
        found = probe(base_url, api_key)
        if found.state == "server" and (model_id := matching_id(found.model_ids, wanted)):
            return ServerHandle(base_url=base_url, model_id=model_id, started=False)
        if found.state == "free":
            return start_server(
                model_ref=model_ref,
                wanted=wanted,
                host=host,
                port=port,
                api_key=api_key,
                log_dir=log_dir,
                timeout_s=timeout_s,
                environ=environ,
                serve_args=serve_args,
            )
    raise KapitsaError(
        f"ports {first_port}-{first_port + PORTS_TO_TRY - 1} on {host} are all taken by other "
        "servers; set KAPITSA_PORT to another range"
    )


def serve_command(model_ref: str, host: str, port: int, serve_args: tuple[str, ...] = ()) -> list[str]:
    return [
        sys.executable,
        "-m",
        "kapitsa",
        "serve",
        "--model",
        model_ref,
        "--host",
        host,
        "--port",
        str(port),
        *serve_args,
    ]


def start_server(
    *,
    model_ref: str,
    wanted: tuple[str, ...],
    host: str,
    port: int,
    api_key: str | None,
    log_dir: Path,
    timeout_s: float,
    environ: Mapping[str, str] | None = None,
    serve_args: tuple[str, ...] = (),
) -> ServerHandle:
    log_path = make_private_dir(log_dir) / f"serve-{port}.log"  # owner only, like the rest of the state
    env = dict(environ if environ is not None else os.environ)
    if api_key:
        env["KAPITSA_API_KEY"] = api_key
    cmd = serve_command(model_ref, host, port, serve_args)
    with os.fdopen(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, PRIVATE_FILE), "ab") as log:
        # A new session: the server outlives this launcher (which exec()s into the agent) and its terminal.
        process = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    base_url = http_url(host, port)
    model_id = _wait_ready(process, base_url, api_key, wanted, log_path, timeout_s)
    return ServerHandle(
        base_url=base_url, model_id=model_id, started=True, pid=process.pid, log_path=log_path
    )


def _wait_ready(
    process: subprocess.Popen[bytes],
    base_url: str,
    api_key: str | None,
    wanted: tuple[str, ...],
    log_path: Path,
    timeout_s: float,
) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise KapitsaError(f"`kapitsa serve` exited with status {process.returncode}:\n{_tail(log_path)}")
        found = probe(base_url, api_key, timeout=2.0)
        if found.state == "server":
            return matching_id(found.model_ids, wanted) or (
                found.model_ids[0] if found.model_ids else wanted[0]
            )
        time.sleep(0.25)
    raise KapitsaError(
        f"`kapitsa serve` (pid {process.pid}) did not answer {base_url}/health within "
        f"{timeout_s:.0f} s; it keeps loading in the background, log: {log_path}"
    )


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
