"""Schema fuzzing (schemathesis) of the server's own OpenAPI document: no input may produce a 5xx (T4),
over a FakeEngine and over the real engine (a tiny checkpoint through the real loading code).

Bounded for CI: `KAPITSA_FUZZ_EXAMPLES` examples per operation (default 25) over the fake engine, and
`KAPITSA_FUZZ_REAL_EXAMPLES` (default 200) over the real one, where schemathesis's own coverage cases come
on top: at the default, at least 2,000 cases (2,170), about a minute on 2 cores.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from server_harness import open_tiny_engine  # noqa: E402

from kapitsa.server.app import create_app  # noqa: E402
from kapitsa.server.settings import ServerSettings  # noqa: E402
from kapitsa.testing.fake_engine import FakeEngine  # noqa: E402

EXAMPLES = int(os.environ.get("KAPITSA_FUZZ_EXAMPLES", "25"))
REAL_EXAMPLES = int(os.environ.get("KAPITSA_FUZZ_REAL_EXAMPLES", "200"))
MIN_REAL_CASES = 2000 if REAL_EXAMPLES >= 200 else 0

# The ASGI test client calls itself "testserver"; allow that name so requests reach the routes.
SETTINGS = ServerSettings(allowed_hosts=["testserver"], keepalive_s=0.05, first_event_wait_s=0.05)
app = create_app(FakeEngine(), SETTINGS)
schema = schemathesis.openapi.from_asgi("/openapi.json", app)


def assert_no_server_error(case: Any, timeout_s: float = 10.0) -> None:
    response = case.call(timeout=timeout_s)
    assert response.status_code < 500, (
        f"{case.method} {case.path} → {response.status_code}: {response.text[:300]}"
    )
    if response.status_code >= 400:
        assert response.headers["content-type"][0].startswith("application/json")


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_input_gives_a_server_error(case: schemathesis.Case) -> None:
    assert_no_server_error(case)


@pytest.fixture(scope="module")
def real_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    # A small window and answers of at most 8 tokens keep each case to milliseconds.
    folder = tmp_path_factory.mktemp("tiny") / "qwen"
    engine = open_tiny_engine(folder, max_output_tokens=8, max_position_embeddings=4096)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def real_engine_schema(real_engine: Any) -> Any:
    return schemathesis.openapi.from_asgi("/openapi.json", create_app(real_engine, SETTINGS))


@pytest.fixture
def cases_run(real_engine: Any) -> Iterator[list[str]]:
    """The cases the test ran (one entry each): at least 2,000 at the default count, and the engine
    still alive afterwards."""
    ran: list[str] = []
    yield ran
    assert len(ran) >= MIN_REAL_CASES, f"only {len(ran)} cases ran"
    assert real_engine.stats().alive


real_schema = schemathesis.pytest.from_fixture("real_engine_schema")


@real_schema.parametrize()
@settings(max_examples=REAL_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_input_gives_the_real_engine_a_server_error(case: schemathesis.Case, cases_run: list[str]) -> None:
    cases_run.append(case.path)
    assert_no_server_error(case, timeout_s=60.0)  # a real forward on a loaded 2-core CI machine
