"""One error family. The CLI prints the message and exits 1; the server maps each class to a status."""

from __future__ import annotations


class KapitsaError(Exception):
    """Base class of every error kapitsa raises on purpose: its message is meant for the user."""

    http_status = 500


class InvalidRequest(KapitsaError):
    """The request is malformed or asks for something impossible."""

    http_status = 400


class ContextOverflow(InvalidRequest):
    """The prompt (plus requested output) does not fit the model's context window."""

    def __init__(self, prompt_tokens: int, max_context: int, message: str | None = None) -> None:
        self.prompt_tokens = prompt_tokens
        self.max_context = max_context
        super().__init__(message or f"prompt is too long: {prompt_tokens} tokens > {max_context} maximum")


class ModelNotFound(KapitsaError):
    """No such model in the catalog, on disk, or in the Hugging Face cache."""

    http_status = 404


class NotDownloaded(ModelNotFound):
    """A model kapitsa knows how to get, whose weights are not on this machine yet."""

    def __init__(self, message: str, *, ref: str) -> None:
        super().__init__(message)
        self.ref = ref  # what `kapitsa pull` takes to fetch it


class UnsupportedModel(KapitsaError):
    """The checkpoint exists but is of an architecture or format kapitsa does not run."""

    http_status = 400


class CheckpointError(KapitsaError):
    """A checkpoint's files are missing, corrupt, or disagree with its config."""

    http_status = 500


class EngineBusy(KapitsaError):
    """Not enough memory (or slots) for this request right now; retrying later may work."""

    http_status = 503


class EngineDead(KapitsaError):
    """The engine thread has stopped; no request can be served."""

    http_status = 503


class AuthError(KapitsaError):
    """Missing or wrong API token."""

    http_status = 401


class NotBuilt(KapitsaError):
    """A command whose implementation has not landed yet. It says so instead of pretending."""


class NoRoutedExperts(InvalidRequest):
    """A recipe for mixture-of-experts models (`:small`) asked of a model without routed experts."""
