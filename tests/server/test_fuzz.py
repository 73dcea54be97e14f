"""Schema fuzzing (schemathesis) of the server's own OpenAPI document: no input may produce a 5xx (T4).

Bounded for CI: `KAPITSA_FUZZ_EXAMPLES` examples per operation (default 25); nightly runs raise it.
"""

from __future__ import annotations

import os

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402

from kapitsa.engine.fake import FakeEngine  # noqa: E402
from kapitsa.server.app import create_app  # noqa: E402
from kapitsa.server.settings import ServerSettings  # noqa: E402

EXAMPLES = int(os.environ.get("KAPITSA_FUZZ_EXAMPLES", "25"))

# The ASGI test client calls itself "testserver"; allow that name so requests reach the routes.
app = create_app(
    FakeEngine(), ServerSettings(allowed_hosts=["testserver"], keepalive_s=0.05, first_event_wait_s=0.05)
)
schema = schemathesis.openapi.from_asgi("/openapi.json", app)


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_input_gives_a_server_error(case: schemathesis.Case) -> None:
    response = case.call()
    assert response.status_code < 500, (
        f"{case.method} {case.path} → {response.status_code}: {response.text[:300]}"
    )
    if response.status_code >= 400:
        assert response.headers["content-type"][0].startswith("application/json")
