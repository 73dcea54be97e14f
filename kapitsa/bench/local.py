"""Opening the local in-process engine for `kapitsa bench --model X`: the opener `kapitsa serve` uses."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from kapitsa.engine.client import EngineClient
from kapitsa.engine.options import DEFAULT_SPECULATIVE
from kapitsa.errors import NotBuilt


@contextlib.contextmanager
def open_local_engine(model: str | None, *, speculative: str = DEFAULT_SPECULATIVE) -> Iterator[EngineClient]:
    """Load `model` (default: the settings' default model) into an engine thread; stop it afterwards."""
    from kapitsa.opener import open_engine

    try:
        engine = open_engine(model, speculative=speculative)
    except NotBuilt as err:
        raise NotBuilt(f"{err}; bench another server with `--no-local --compare URL`") from err
    with contextlib.closing(engine) as client:
        yield client
