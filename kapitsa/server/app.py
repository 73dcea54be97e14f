"""`create_app(client, settings)`: the FastAPI app. Routes live in one module per API; this wires them up."""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from kapitsa import __version__
from kapitsa.engine.client import EngineClient
from kapitsa.errors import ModelNotFound
from kapitsa.server import anthropic, openai_chat, openai_completions, openai_responses
from kapitsa.server.common import ServerState, now, resolve_model, state_of
from kapitsa.server.errors import install_error_handlers
from kapitsa.server.metrics import prometheus_text
from kapitsa.server.response_store import ResponseStore
from kapitsa.server.security import SecurityMiddleware
from kapitsa.server.settings import ServerSettings


def create_app(client: EngineClient, settings: ServerSettings | None = None) -> FastAPI:
    """The HTTP app over `client`. Security (Host, Origin, token, content type, body cap) wraps every route."""
    settings = settings or ServerSettings()
    app = FastAPI(title="kapitsa", version=__version__, docs_url=None, redoc_url=None)
    responses = ResponseStore(
        max_responses=settings.max_stored_responses, max_age_s=settings.stored_response_max_age_s
    )
    app.state.kapitsa = ServerState(client=client, settings=settings, responses=responses)
    install_error_handlers(app)
    for module in (openai_chat, openai_completions, openai_responses, anthropic):
        app.include_router(module.router)
    _add_service_routes(app)
    app.add_middleware(SecurityMiddleware, settings=settings)
    return app


def _add_service_routes(app: FastAPI) -> None:
    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def root() -> dict[str, str]:
        # Claude Code sends `HEAD /` as a preconnect before its first request.
        return {"name": "kapitsa", "version": __version__}

    @app.get("/health")
    async def health(request: Request) -> Response:
        stats = state_of(request).client.stats()
        body: dict[str, Any] = {
            "status": "ok" if stats.alive else "dead",
            "model": stats.model,
            "active_requests": stats.active_requests,
            "queued_requests": stats.queued_requests,
        }
        return JSONResponse(body, status_code=200 if stats.alive else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> PlainTextResponse:
        return PlainTextResponse(
            prometheus_text(state_of(request).client.stats()), media_type="text/plain; version=0.0.4"
        )

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict[str, Any]:
        models = [_model_entry(m) for m in state_of(request).client.models()]
        # One body for both APIs: OpenAI reads `object`/`data`; Anthropic's pagination fields ride along.
        first, last = (models[0]["id"], models[-1]["id"]) if models else (None, None)
        return {"object": "list", "data": models, "has_more": False, "first_id": first, "last_id": last}

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str, request: Request) -> dict[str, Any]:
        # Anthropic clients retrieve the Claude name they were configured with, which maps to the served model
        anthropic = "anthropic-version" in request.headers
        if not model_id:  # resolve_model reads an empty name as the default model
            raise ModelNotFound("Name a model: GET /v1/models/{id}.")
        info = resolve_model(state_of(request).client, model_id, anthropic=anthropic)
        return {**_model_entry(info), "id": model_id}


_STARTED_AT = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _model_entry(model: Any) -> dict[str, Any]:
    return {
        "id": model.id,
        "object": "model",
        "created": now(),
        "owned_by": "kapitsa",
        # Anthropic's /v1/models shape shares `id`; these extras let launchers size context windows.
        "type": "model",
        "display_name": model.id,
        "created_at": _STARTED_AT,
        "context_length": model.context_length,
        "max_output_tokens": model.max_output_tokens,
    }
