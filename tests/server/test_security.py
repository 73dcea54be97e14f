"""Front-door security: Host allow-list (DNS rebinding), Origin/CORS, token auth on every route, body caps (T6, T7)."""

from __future__ import annotations

import inspect
import socket
from collections.abc import Iterator

import httpx
import pytest
from server_harness import LiveServer, live_server

from kapitsa.errors import InvalidRequest
from kapitsa.server import security
from kapitsa.server.app import create_app
from kapitsa.server.runner import check_bind
from kapitsa.server.settings import ServerSettings
from kapitsa.testing.fake_engine import FakeEngine

TOKEN = "s3cret-token-value"


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with live_server(cors_origins=["https://app.example"]) as live:
        yield live


def raw_request(port: int, head: str, body: bytes = b"") -> int:
    """Send bytes as they are (duplicate or missing headers included) and return the status code."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(head.replace("\n", "\r\n").encode() + b"\r\n" + body)
        status_line = sock.makefile("rb").readline().decode()
    return int(status_line.split()[1])


BAD_HOSTS = [
    "evil.example",
    "evil.example:{port}",
    "127.0.0.1.nip.io",
    "localhost.evil.example",
    "[::2]",
    "[::2]:{port}",
    "10.0.0.5",
    "localhost:abc",
    "127.0.0.1:{port}@evil.example",
]
GOOD_HOSTS = ["127.0.0.1:{port}", "localhost:{port}", "[::1]:{port}", "127.0.0.1", "LOCALHOST:{port}"]


@pytest.mark.parametrize("host", BAD_HOSTS)
def test_rebinding_hosts_get_403(server: LiveServer, host: str) -> None:
    response = httpx.get(server.url + "/v1/models", headers={"host": host.format(port=server.port)})
    assert response.status_code == 403
    assert "fake" not in response.text  # no body leak


@pytest.mark.parametrize("host", GOOD_HOSTS)
def test_loopback_hosts_pass(server: LiveServer, host: str) -> None:
    assert (
        httpx.get(server.url + "/v1/models", headers={"host": host.format(port=server.port)}).status_code
        == 200
    )


def test_missing_empty_and_double_host_get_403(server: LiveServer) -> None:
    assert raw_request(server.port, "GET /health HTTP/1.1\nHost: \n") == 403
    assert raw_request(
        server.port, f"GET /health HTTP/1.1\nHost: 127.0.0.1:{server.port}\nHost: evil.example\n"
    ) in (400, 403)
    assert raw_request(server.port, "GET /health HTTP/1.0\n") == 403
    bad_with_forwarded = "GET /health HTTP/1.1\nHost: evil.example\nX-Forwarded-Host: localhost\n"
    assert raw_request(server.port, bad_with_forwarded) == 403


def test_foreign_origin_is_refused_and_gets_no_cors(server: LiveServer) -> None:
    evil = {"origin": "https://evil.example"}
    preflight = httpx.options(
        server.url + "/v1/chat/completions", headers={**evil, "access-control-request-method": "POST"}
    )
    assert "access-control-allow-origin" not in preflight.headers
    assert httpx.get(server.url + "/v1/models", headers=evil).status_code == 403
    post = httpx.post(
        server.url + "/v1/chat/completions",
        headers=evil,
        json={"messages": [{"role": "user", "content": "x"}]},
    )
    assert post.status_code == 403 and "access-control-allow-origin" not in post.headers


def test_same_origin_and_listed_origin(server: LiveServer) -> None:
    assert httpx.get(server.url + "/v1/models", headers={"origin": server.url}).status_code == 200
    listed = {"origin": "https://app.example"}
    preflight = httpx.options(
        server.url + "/v1/messages", headers={**listed, "access-control-request-method": "POST"}
    )
    assert preflight.headers["access-control-allow-origin"] == "https://app.example"
    assert "access-control-allow-credentials" not in preflight.headers
    response = httpx.get(server.url + "/v1/models", headers=listed)
    assert response.headers["access-control-allow-origin"] == "https://app.example"


def test_chunked_body_over_the_cap_is_413() -> None:
    with live_server(max_body_bytes=4096) as live:
        chunks = (b'{"messages": "' + b"x" * 1024 for _ in range(10))
        response = httpx.post(
            live.url + "/v1/messages", content=chunks, headers={"content-type": "application/json"}
        )
        assert response.status_code == 413
        assert response.json()["error"]["type"] == "request_too_large"


@pytest.fixture(scope="module")
def secured() -> Iterator[LiveServer]:
    with live_server(api_key=TOKEN) as live:
        yield live


def _routes() -> list[tuple[str, str]]:
    app = create_app(FakeEngine(), ServerSettings(api_key=TOKEN))
    return sorted(
        (method, route.path)
        for route in app.routes
        for method in set(getattr(route, "methods", None) or ()) - {"HEAD"}
    )


@pytest.mark.parametrize(("method", "path"), _routes())
def test_every_route_but_health_needs_the_token(secured: LiveServer, method: str, path: str) -> None:
    response = httpx.request(method, secured.url + path, json={} if method == "POST" else None)
    if path == "/health":
        assert response.status_code == 200
        return
    assert response.status_code == 401
    body = response.json()
    error_type = body["error"]["type"]
    assert error_type == "authentication_error"
    assert (body["type"] == "error") if path.startswith("/v1/messages") else ("code" in body["error"])


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"authorization": "Bearer wrong"},
        {"authorization": f"Bearer {TOKEN.upper()}"},
        {"x-api-key": TOKEN[:-1]},
        {"authorization": TOKEN},
        {"x-api-key": ""},
    ],
)
def test_wrong_tokens_get_401(secured: LiveServer, headers: dict[str, str]) -> None:
    assert httpx.get(secured.url + "/v1/models", headers=headers).status_code == 401


@pytest.mark.parametrize(
    "headers",
    [{"authorization": f"Bearer {TOKEN}"}, {"authorization": f"bearer {TOKEN}"}, {"x-api-key": TOKEN}],
)
def test_right_token_passes(secured: LiveServer, headers: dict[str, str]) -> None:
    assert httpx.get(secured.url + "/v1/models", headers=headers).status_code == 200


def test_token_comparison_is_constant_time() -> None:
    source = inspect.getsource(security.SecurityMiddleware._check_token)
    assert "hmac.compare_digest" in source
    assert (
        "== self.token" not in source and "self.token ==" not in source and ".lower() == self" not in source
    )


def test_non_loopback_bind_needs_a_token() -> None:
    with pytest.raises(InvalidRequest, match="without a token"):
        check_bind(ServerSettings(host="0.0.0.0"))
    check_bind(ServerSettings(host="0.0.0.0", api_key=TOKEN))
    check_bind(ServerSettings(host="::1"))


def test_non_loopback_bind_accepts_ip_literals_but_not_names() -> None:
    mw = security.SecurityMiddleware(lambda *a: None, ServerSettings(host="0.0.0.0", api_key=TOKEN))  # type: ignore[arg-type]
    assert mw._host_allowed("192.168.1.20") and mw._host_allowed("localhost")
    assert not mw._host_allowed("evil.example")
