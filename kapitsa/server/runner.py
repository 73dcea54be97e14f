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

_HEADER_LIMIT = 64 * 1024  # uvicorn's h11 header cap, in bytes (431 above it)


def check_bind(settings: ServerSettings) -> None:
    """A non-loopback bind without a token would hand the machine's model to the whole network; a blank
    token (an empty variable, a stray space) is no token."""
    if not is_loopback_host(settings.host) and not (settings.api_key or "").strip():
        raise InvalidRequest(
            f"Refusing to listen on {settings.host} without a token: set KAPITSA_API_KEY to a non-blank token "
            "(clients then send it as `Authorization: Bearer …` or `x-api-key`), or bind to 127.0.0.1."
        )


def check_port_free(settings: ServerSettings) -> None:
    """Fail before loading the model (which can take minutes) when the port is already taken."""
    if settings.port == 0:
        return
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((settings.host, settings.port))
        except OSError as exc:
            raise KapitsaError(
                f"cannot listen on {settings.host}:{settings.port} ({exc.strerror}); pass --port or set KAPITSA_PORT"
            ) from None


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
        server_header=False,
        lifespan="off",
    )
    return uvicorn.Server(config)


def serve_forever(client: EngineClient, settings: ServerSettings) -> None:
    """Serve until SIGINT/SIGTERM; in-flight streams get `drain_s` to finish."""
    server = make_server(client, settings)
    if not is_loopback_host(settings.host):
        print(
            f"WARNING: kapitsa is listening on {settings.host}:{settings.port}, reachable from the network "
            "(token required on every request).",
            file=sys.stderr,
        )
    print(
        f"kapitsa serving {', '.join(m.id for m in client.models())} on http://{settings.host}:{settings.port}",
        file=sys.stderr,
    )
    with _signals_end_serving():
        server.run()


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
