"""Fixtures for engine tests; the stand-ins live in engine_standins.py."""

from __future__ import annotations

import pytest
from engine_standins import EOS, OFFSET, ByteDetokenizer, ByteTokenizer, tiny_model  # noqa: F401 - re-exported

from kapitsa.engine.inprocess import InProcessEngine
from kapitsa.engine.options import EngineConfig
from kapitsa.engine.types import ModelInfo

FAMILIES = ("qwen3_5", "nemotron_h")
_MODELS: dict[str, object] = {}


@pytest.fixture(scope="session")
def qwen_model():
    return _cached_model("qwen3_5")


@pytest.fixture(params=FAMILIES)
def family_model(request):
    """Each family's tiny model in turn."""
    return _cached_model(request.param)


def _cached_model(kind: str):
    if kind not in _MODELS:
        _MODELS[kind] = tiny_model(kind)
    return _MODELS[kind]


@pytest.fixture
def make_client():
    """make_client(model, **engine_config) -> InProcessEngine with the byte tokenizer; closed after."""
    made: list[InProcessEngine] = []

    def make(model, *, context_length: int = 4096, **cfg) -> InProcessEngine:
        info = ModelInfo(id="tiny", family="test", context_length=context_length, max_output_tokens=1024)
        cfg.setdefault("prefill_chunk", 64)  # the CPU reference GDN scan grows faster than linear in T
        client = InProcessEngine(
            model, ByteTokenizer(), info, eos_token_ids={EOS}, config=EngineConfig(**cfg)
        )
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()
