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
