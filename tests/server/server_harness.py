"""A real uvicorn server over a FakeEngine or a real tiny engine, for the server tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kapitsa.server.runner import make_server
from kapitsa.server.settings import ServerSettings
from kapitsa.testing.fake_engine import FakeEngine


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


def open_tiny_engine(
    folder: Path, kind: str = "qwen3_5", *, max_output_tokens: int | None = None, **checkpoint: Any
) -> Any:
    """A real `InProcessEngine` over a tiny random checkpoint written to `folder` and read back by the
    real loading code (tokenizer.json, chat template, generation_config); `max_output_tokens` caps
    every answer (the engine clamps requests to it)."""
    import dataclasses

    from kapitsa.engine.inprocess import InProcessEngine
    from kapitsa.engine.loading.loader import load_model
    from kapitsa.engine.options import EngineConfig
    from kapitsa.testing.tiny import write_tiny_checkpoint

    loaded = load_model(write_tiny_checkpoint(folder, kind, **checkpoint))  # type: ignore[arg-type]
    if max_output_tokens is not None:
        loaded = dataclasses.replace(
            loaded, info=dataclasses.replace(loaded.info, max_output_tokens=max_output_tokens)
        )
    return InProcessEngine.from_loaded(loaded, config=EngineConfig(prefill_chunk=64))


def assert_error_shape(path: str, response: Any, status: int, param: str | None = None) -> dict[str, Any]:
    """`response` is a `status` error in the shape of the API `path` belongs to; returns its body."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    else:
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
        if param is not None:
            assert body["error"]["param"] == param, body
    assert body["error"]["message"], body
    return body  # type: ignore[no-any-return]


@contextmanager
def tiny_engine_client(folder: Path, kind: str) -> Iterator[Any]:
    """An `httpx.Client` on a live server over `open_tiny_engine(folder, kind)`, its `model_id` set."""
    import httpx

    engine = open_tiny_engine(folder, kind)
    try:
        with live_server(engine) as live, httpx.Client(base_url=live.url, timeout=120) as client:
            client.model_id = client.get("/v1/models").json()["data"][0]["id"]
            yield client
    finally:
        engine.close()


def grammar_accepts(compiler: Any, constraint: Any, text: str) -> bool:
    """Whether the grammar of `constraint` accepts `text` whole; `compiler`: conftest's (compiler, tokenizer)."""
    grammars, tok = compiler
    state = grammars.make(constraint)
    try:
        for token in tok.encode(text):
            state.advance(token)
    except Exception:  # noqa: BLE001 - the grammar refused a token
        return False
    return state.is_accepting
