"""The server's front door, as one raw ASGI middleware (no BaseHTTPMiddleware: it breaks streaming and disconnects).

Order: Host allow-list (DNS rebinding) → Origin/CORS → token → content type → body cap. Decisions use
`scope["path"]` and raw headers only, never `request.url` (Starlette's Host-derived URL can be poisoned).
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from kapitsa.server.errors import ApiError, error_body_bytes
from kapitsa.server.settings import ServerSettings

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "[::1]"})
PUBLIC_PATHS = frozenset({"/health"})
_JSON_TYPES = ("application/json",)


def is_loopback_host(host: str) -> bool:
    if host in ("localhost", "::1", "[::1]"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _host_name(value: str) -> str | None:
    """The host part of a `Host` header (`name`, `1.2.3.4` or `[v6]`), or None when it is malformed."""
    value = value.strip().lower()
    if not value:
        return None
    if value.startswith("["):
        end = value.find("]")
        name, rest = value[: end + 1], value[end + 1 :]
    else:
        name, _, port = value.partition(":")
        rest = f":{port}" if _ else ""
    if rest and not (rest.startswith(":") and rest[1:].isdigit()):
        return None
    return name or None


def _is_ip_literal(name: str) -> bool:
    try:
        ipaddress.ip_address(name.strip("[]"))
        return True
    except ValueError:
        return False


class SecurityMiddleware:
    def __init__(self, app: ASGIApp, settings: ServerSettings) -> None:
        self.app = app
        self.settings = settings
        self.loopback_only = is_loopback_host(settings.host)
        bind = settings.host.lower()
        self.allowed_hosts = LOOPBACK_NAMES | {h.lower() for h in settings.allowed_hosts} | {bind}
        self.cors_origins = frozenset(o.rstrip("/") for o in settings.cors_origins)
        # Presented tokens are compared stripped, so the key is too; a blank key is no key.
        key = (settings.api_key or "").strip()
        self.token = key.encode() if key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        try:
            host = self._check_host(headers)
            origin = self._check_origin(headers, host)
            if scope["method"] == "OPTIONS":
                await self._preflight(origin, send)
                return
            self._check_token(scope["path"], headers)
            if scope["method"] in ("POST", "PUT", "PATCH"):
                _check_content_type(headers)
                receive = await self._buffer_body(headers, receive)
        except ApiError as err:
            await _send_error(send, scope["path"], err)
            return
        await self.app(scope, receive, _with_cors(send, origin) if origin in self.cors_origins else send)

    def _check_host(self, headers: dict[str, list[str]]) -> str:
        values = headers.get("host", [])
        name = _host_name(values[0]) if len(values) == 1 else None
        if name is None or not self._host_allowed(name):
            raise ApiError(403, "Host not allowed.")
        return values[0].strip().lower()

    def _host_allowed(self, name: str) -> bool:
        if name in self.allowed_hosts:
            return True
        # IP literals cannot be DNS-rebound; on a non-loopback bind they are how LAN clients arrive.
        return not self.loopback_only and _is_ip_literal(name)

    def _check_origin(self, headers: dict[str, list[str]], host: str) -> str | None:
        origins = headers.get("origin")
        if not origins:
            return None
        origin = origins[0].strip().rstrip("/")
        same_origin = origin in (f"http://{host}", f"https://{host}")
        if len(origins) > 1 or not (same_origin or origin in self.cors_origins):
            raise ApiError(403, "Origin not allowed.")
        return origin

    async def _preflight(self, origin: str | None, send: Send) -> None:
        if origin is None or origin not in self.cors_origins:
            await _send_raw(send, 204, b"", [])
            return
        await _send_raw(
            send,
            204,
            b"",
            _cors_headers(origin)
            + [
                (b"access-control-allow-methods", b"GET, POST, DELETE, OPTIONS"),
                (
                    b"access-control-allow-headers",
                    b"authorization, x-api-key, content-type, anthropic-version, anthropic-beta",
                ),
                (b"access-control-max-age", b"600"),
            ],
        )

    def _check_token(self, path: str, headers: dict[str, list[str]]) -> None:
        if self.token is None or path in PUBLIC_PATHS:
            return
        presented = [v[7:].strip() for v in headers.get("authorization", []) if v[:7].lower() == "bearer "]
        presented += headers.get("x-api-key", [])
        # Check every presented value in constant time; any exact match passes.
        matches = [hmac.compare_digest(p.encode(), self.token) for p in presented]
        if not any(matches):
            raise ApiError(401, "Missing or invalid API key.", code="invalid_api_key")

    async def _buffer_body(self, headers: dict[str, list[str]], receive: Receive) -> Receive:
        """Read the whole body (up to the cap) before the app runs, then replay it; the cap counts real bytes."""
        limit = self.settings.max_body_bytes
        declared = headers.get("content-length", ["0"])[0]
        if declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"Request body is larger than {limit} bytes.")
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return _replay(b"", receive, disconnected=True)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"Request body is larger than {limit} bytes.")
            chunks.append(chunk)
            more = message.get("more_body", False)
        return _replay(b"".join(chunks), receive)


def _check_content_type(headers: dict[str, list[str]]) -> None:
    content_type = headers.get("content-type", [""])[0].split(";")[0].strip().lower()
    if content_type not in _JSON_TYPES:
        raise ApiError(415, "Content-Type must be application/json.")


def _replay(body: bytes, receive: Receive, *, disconnected: bool = False) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if disconnected:
            return {"type": "http.disconnect"}
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _headers(scope: Scope) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for raw_name, raw_value in scope.get("headers", []):
        out.setdefault(raw_name.decode("latin-1").lower(), []).append(raw_value.decode("latin-1"))
    return out


def _cors_headers(origin: str) -> list[tuple[bytes, bytes]]:
    return [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]


def _with_cors(send: Send, origin: str) -> Send:
    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start":
            message["headers"] = list(message.get("headers", [])) + _cors_headers(origin)
        await send(message)

    return wrapped


async def _send_raw(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _send_error(send: Send, path: str, err: ApiError) -> None:
    body = error_body_bytes(path, err)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await _send_raw(send, err.status, body, headers)
