"""Server settings: command-line flags override `KAPITSA_*` environment variables, which override defaults."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from kapitsa.engine.options import DEFAULT_SPECULATIVE

DEFAULT_PORT = 8484
"""The documented default port (8080 and 11434 are taken by llama.cpp and Ollama on many machines)."""

MAX_MESSAGES = 10_000
"""Most messages (or Responses input items) one request may carry."""

MAX_CHOICES = 8
"""Most choices (`n`) one chat or completions request may ask for; each decodes its own copy of the prompt's state."""

MAX_BODY_BYTES = 32 * 1024 * 1024
"""Anthropic's own request limit; larger bodies get 413."""

MAX_STORED_RESPONSES = 1000
"""Responses API responses kept at once by default; storing one more drops the oldest."""

STORED_RESPONSE_MAX_AGE_S = 24 * 3600.0
"""Seconds a stored response stays retrievable by default."""


class ServerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KAPITSA_", extra="ignore")

    host: str = "127.0.0.1"
    """Bind address. Anything but loopback requires `api_key`."""

    port: int = Field(DEFAULT_PORT, ge=0, le=65535)
    """TCP port (0 picks a free one)."""

    api_key: str | None = None
    """When set, every route except `/health` needs `Authorization: Bearer <key>` or `x-api-key: <key>`."""

    allowed_hosts: list[str] = []
    """Extra `Host` header names accepted besides loopback names and the bind address (DNS-rebinding guard)."""

    cors_origins: list[str] = []
    """Exact browser origins allowed to call the API. Empty (the default) sends no CORS headers at all."""

    max_body_bytes: int = Field(MAX_BODY_BYTES, ge=1024)
    """Largest request body accepted; larger ones get 413."""

    keepalive_s: float = Field(5.0, gt=0)
    """Seconds without output before a stream sends a keep-alive (`ping` event or SSE comment)."""

    first_event_wait_s: float = Field(2.0, ge=0)
    """How long a stream waits for the engine's first event before sending headers, so early errors get a real status."""

    drain_s: float = Field(30.0, ge=0)
    """On shutdown, how long in-flight streams may take to finish."""

    max_stored_responses: int = Field(MAX_STORED_RESPONSES, ge=1)
    """Responses API responses kept for `previous_response_id` and `GET /v1/responses/{id}` (in memory; the oldest goes first)."""

    stored_response_max_age_s: float = Field(STORED_RESPONSE_MAX_AGE_S, gt=0)
    """Seconds a stored response stays retrievable."""

    model: str | None = None
    """Model to serve (catalog alias, HF repo id, folder)."""

    speculative: str = DEFAULT_SPECULATIVE
    """Speculative decoding mode handed to the engine."""

    reasoning_budget: int | None = Field(None, ge=1)
    """Most tokens an answer thinks before `</think>` is forced, for requests that set no budget of
    their own (Anthropic's `thinking.budget_tokens`); None: thinking runs as long as the model likes."""
