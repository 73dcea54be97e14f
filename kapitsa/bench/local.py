"""Opening the local in-process engine for `kapitsa bench --model X`, behind one small adapter."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator

from kapitsa.engine.client import EngineClient
from kapitsa.errors import NotBuilt


@contextlib.contextmanager
def open_local_engine(model: str | None, *, speculative: str = "none") -> Iterator[EngineClient]:
    """Load `model` into an in-process engine thread, yield its client, and stop it afterwards."""
    try:
        inprocess = importlib.import_module("kapitsa.engine.inprocess")
    except ImportError as err:
        raise NotBuilt(
            "the in-process engine is not available in this build, so `kapitsa bench` cannot run a local "
            "model; bench another server with `--no-local --compare URL`"
        ) from err
    client = inprocess.open_engine(model, speculative=speculative)
    try:
        yield client
    finally:
        client.close()
