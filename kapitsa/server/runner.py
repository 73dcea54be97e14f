"""Running the app under uvicorn: bind checks, graceful drain, and the address banner."""

from __future__ import annotations

import contextlib
import signal
import socket
import sys
import threading
from collections.abc import Iterator

import uvicorn

from kapitsa.engine.client import EngineClient
from kapitsa.errors import InvalidRequest, KapitsaError
from kapitsa.server.app import create_app
from kapitsa.server.security import is_loopback_host
from kapitsa.server.settings import ServerSettings
from kapitsa.server_state import http_url

_HEADER_LIMIT = 64 * 1024  # the most of an incomplete request head h11 buffers (refused above it)


def check_bind(settings: ServerSettings) -> None:
    """A non-loopback bind without a token would hand the machine's model to the whole network; a blank
    token (an empty variable, a stray space) is no token."""
    if not is_loopback_host(settings.host) and not (settings.api_key or "").strip():
        raise InvalidRequest(
            f"Refusing to listen on {settings.host} without a token: set KAPITSA_API_KEY to a non-blank token "
            "(clients then send it as `Authorization: Bearer …` or `x-api-key`), or bind to 127.0.0.1."
        )


def reserve_port(host: str, port: int) -> socket.socket:
    """Bind the server's address now, before the model loads (which can take minutes): a port another
    server listens on fails at once, and port 0 learns the port it got. The socket listens only once
    `serve_forever` starts, so until then a client is refused as if no server ran. Like uvicorn's bind
    it sets SO_REUSEADDR (a restart is not blocked by the last run's TIME_WAIT connections), so another
    such bind can still share the port until one listens: `serve_forever` reports that case."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise KapitsaError(
            f"cannot listen on {host}:{port} ({exc.strerror}); pass --port or set KAPITSA_PORT"
        ) from None
    return sock


def check_port_free(settings: ServerSettings) -> None:
    """Fail early when the port is taken, for a process that does not serve it itself (a group's launcher)."""
    reserve_port(settings.host, settings.port).close()


def bound_port(sock: socket.socket) -> int:
    return int(sock.getsockname()[1])


def make_server(client: EngineClient, settings: ServerSettings) -> uvicorn.Server:
    check_bind(settings)
    config = uvicorn.Config(
        create_app(client, settings),
        host=settings.host,
        port=settings.port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=int(settings.drain_s) or None,
        h11_max_incomplete_event_size=_HEADER_LIMIT,
        http="h11",  # its header cap answers oversized headers; httptools, if installed, has none
        loop="auto",  # uvloop where installed (a dependency off Windows): less loop work per token
        server_header=False,
        lifespan="off",
    )
    return uvicorn.Server(config)


def serve_forever(client: EngineClient, settings: ServerSettings, sock: socket.socket | None = None) -> None:
    """Serve until SIGINT/SIGTERM; in-flight streams get `drain_s` to finish. `sock`: the address
    `reserve_port` bound (`settings.port` then names its port); without it uvicorn binds its own."""
    server = make_server(client, settings)
    if sock is not None:
        _listen(sock, settings, server.config.backlog)
    if not is_loopback_host(settings.host):
        print(
            f"WARNING: kapitsa is listening on {settings.host}:{settings.port}, reachable from the network "
            "(token required on every request).",
            file=sys.stderr,
        )
    print(
        f"kapitsa serving {', '.join(m.id for m in client.models())} on {http_url(settings.host, settings.port)}",
        file=sys.stderr,
    )
    with _signals_end_serving():
        server.run(sockets=None if sock is None else [sock])


def _listen(sock: socket.socket, settings: ServerSettings, backlog: int) -> None:
    """Start listening; fails when another server began listening on the port while this one loaded
    (a reserved port only stops others from binding it, not from listening first)."""
    try:
        sock.listen(backlog)
    except OSError as exc:
        raise KapitsaError(
            f"cannot listen on {settings.host}:{settings.port} ({exc.strerror}): another server took it while "
            "the model loaded; pass --port or set KAPITSA_PORT"
        ) from None


@contextlib.contextmanager
def _signals_end_serving() -> Iterator[None]:
    """uvicorn drains on SIGINT/SIGTERM and then re-raises the signal; with these handlers that re-raise
    only ends `run()`, so the caller can still close the engine (and flush its disk cache)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
