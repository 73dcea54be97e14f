"""Errors in each API's own shape. One mapping from `KapitsaError` classes to status + type, two renderers.

OpenAI:    {"error": {"message", "type", "param", "code"}}
Anthropic: {"type": "error", "error": {"type", "message"}}
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from kapitsa.errors import (
    AuthError,
    ContextOverflow,
    EngineBusy,
    EngineDead,
    InvalidRequest,
    KapitsaError,
    ModelNotFound,
    UnsupportedModel,
)
from kapitsa.server.streaming import ClientGone

log = logging.getLogger("kapitsa.server")

_ANTHROPIC_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
_OPENAI_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}


@dataclass(slots=True)
class ApiError(Exception):
    """An HTTP error with everything both renderers need."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] | None = None
    anthropic_message: str | None = None  # Anthropic's own wording, where clients match on it

    def __str__(self) -> str:
        return self.message


def param_error(param: str, message: str) -> InvalidRequest:
    """An `InvalidRequest` that names the offending field (OpenAI's `error.param`)."""
    err = InvalidRequest(message)
    err.param = param  # type: ignore[attr-defined]
    return err


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def api_error_from_kapitsa(exc: KapitsaError) -> ApiError:
    """The status and code a `KapitsaError` maps to."""
    if isinstance(exc, ContextOverflow):
        # Claude Code recovers (compacts) by matching Anthropic's exact wording.
        wording = f"prompt is too long: {exc.prompt_tokens} tokens > {exc.max_context} maximum"
        return ApiError(
            400, str(exc), param="messages", code="context_length_exceeded", anthropic_message=wording
        )
    if isinstance(exc, ModelNotFound):
        return ApiError(404, str(exc), param="model", code="model_not_found")
    if isinstance(exc, (EngineBusy, EngineDead)):
        return ApiError(503, str(exc), code="overloaded", headers={"Retry-After": "5"})
    if isinstance(exc, AuthError):
        return ApiError(401, str(exc), code="invalid_api_key")
    if isinstance(exc, (InvalidRequest, UnsupportedModel)):
        return ApiError(400, str(exc), param=getattr(exc, "param", None))
    return ApiError(500, str(exc), code="internal_error")


def openai_error_body(err: ApiError) -> dict[str, Any]:
    error_type = _OPENAI_TYPE_BY_STATUS.get(
        err.status, "server_error" if err.status >= 500 else "invalid_request_error"
    )
    return {"error": {"message": err.message, "type": error_type, "param": err.param, "code": err.code}}


def anthropic_error_body(err: ApiError) -> dict[str, Any]:
    error_type = _ANTHROPIC_TYPE_BY_STATUS.get(
        err.status, "api_error" if err.status >= 500 else "invalid_request_error"
    )
    return {"type": "error", "error": {"type": error_type, "message": err.anthropic_message or err.message}}


def error_response(path: str, err: ApiError) -> JSONResponse:
    """Render `err` in the shape of the API that `path` belongs to (Anthropic overload is 529)."""
    if is_anthropic_path(path):
        status = 529 if err.status == 503 else err.status
        return JSONResponse(anthropic_error_body(err), status_code=status, headers=err.headers)
    return JSONResponse(openai_error_body(err), status_code=err.status, headers=err.headers)


def error_body_bytes(path: str, err: ApiError) -> bytes:
    body = anthropic_error_body(err) if is_anthropic_path(path) else openai_error_body(err)
    return json.dumps(body).encode()


def _validation_error(exc: RequestValidationError) -> ApiError:
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return ApiError(400, "The request body is not valid JSON.")
    where = f" at `{'.'.join(loc)}`" if loc else ""
    return ApiError(
        400, f"Invalid request{where}: {first.get('msg', 'invalid value')}", param=loc[0] if loc else None
    )


def install_error_handlers(app: FastAPI) -> None:
    """One place that turns every exception into its API's error shape; nothing escapes as a bare 500."""

    @app.exception_handler(ApiError)
    async def _api(request: Request, exc: ApiError) -> Response:
        return error_response(request.scope["path"], exc)

    @app.exception_handler(KapitsaError)
    async def _kapitsa(request: Request, exc: KapitsaError) -> Response:
        return error_response(request.scope["path"], api_error_from_kapitsa(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        return error_response(request.scope["path"], _validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        return error_response(request.scope["path"], ApiError(exc.status_code, str(exc.detail)))

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nobody is listening; the generation is already aborted

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unexpected error on %s", request.url.path)
        return error_response(request.scope["path"], ApiError(500, f"Internal error: {type(exc).__name__}"))
