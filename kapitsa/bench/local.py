"""Opening the local in-process engine for `kapitsa bench --model X`: the same loading `kapitsa serve` does."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from types import ModuleType

from kapitsa.engine.client import EngineClient
from kapitsa.errors import NotBuilt


def _require(module: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise NotBuilt(
            f"the in-process engine is not available in this build ({module}: {err}); "
            "bench another server with `--no-local --compare URL`"
        ) from err


@contextlib.contextmanager
def open_local_engine(model: str | None, *, speculative: str = "none") -> Iterator[EngineClient]:
    """Load `model` (default: the settings' default model) into an engine thread; stop it afterwards."""
    run_cmd = _require("kapitsa.run_cmd")
    inprocess = _require("kapitsa.engine.inprocess")
    factory = _require("kapitsa.engine.speculative.factory")
    loaded = run_cmd.load_for_spec(model or run_cmd.default_model())
    decode = factory.make_decode_strategy(speculative, target_model=loaded.model)
    client = inprocess.InProcessEngine.from_loaded(loaded, decode=decode)
    try:
        yield client
    finally:
        client.close()
