"""A real uvicorn server over a FakeEngine, for the server tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from kapitsa.engine.fake import FakeEngine
from kapitsa.server.runner import make_server
from kapitsa.server.settings import ServerSettings


@dataclass
class LiveServer:
    url: str
    port: int
    engine: FakeEngine
    server: object

    @property
    def v1(self) -> str:
        return self.url + "/v1"


@contextmanager
def live_server(engine: FakeEngine | None = None, **settings: object) -> Iterator[LiveServer]:
    """A real uvicorn server on 127.0.0.1 and a free port, in a background thread."""
    engine = engine or FakeEngine()
    server = make_server(engine, ServerSettings(**{"port": 0, "keepalive_s": 0.5, "drain_s": 5, **settings}))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("server did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield LiveServer(f"http://127.0.0.1:{port}", port, engine, server)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
