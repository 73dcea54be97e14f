from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from server_harness import LiveServer, live_server


@pytest.fixture
def live() -> Iterator[LiveServer]:
    with live_server() as server:
        yield server


@pytest.fixture
def http(live: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live.url, timeout=10) as client:
        yield client


@pytest.fixture(scope="module")
def compiler(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, object]:
    """llguidance's grammar compiler over the tiny qwen3_5 tokenizer, and that tokenizer."""
    from kapitsa.engine.text.constraint import GrammarCompiler
    from kapitsa.engine.text.tokenizer import Tokenizer
    from kapitsa.testing.tiny import write_tiny_checkpoint

    tok = Tokenizer.from_folder(write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "qwen3_5"))
    return GrammarCompiler(tok.backend, vocab_size=tok.vocab_size, eos_ids=tok.eos_token_ids), tok
