"""The launch context when a caller has only a server URL and a model (the TUI, `kapitsa env`-like uses)."""

from __future__ import annotations

from kapitsa.agents.base import LaunchContext
from kapitsa.catalog import ResolvedModel, arch_for_folder, load_catalog, resolve_model
from kapitsa.errors import KapitsaError
from kapitsa.settings import KapitsaSettings, load_settings

PLACEHOLDER_KEY = "kapitsa"  # the loopback server without a token accepts any key
FALLBACK_LIMITS = (32768, 8192)


def model_window(model: ResolvedModel) -> tuple[int, int]:
    """The model's own context window and output limit (catalog entry, else the checkpoint's config)."""
    arch = model.entry.arch if model.entry is not None else None
    if arch is None and model.path is not None and (model.path / "config.json").is_file():
        try:
            arch = arch_for_folder(model.path)
        except KapitsaError:
            arch = None
    if arch is None:
        return FALLBACK_LIMITS
    return arch.context_length, min(arch.max_output, arch.context_length // 2)


def default_context(
    server_url: str, model: str, settings: KapitsaSettings | None = None, api_key: str | None = None
) -> LaunchContext:
    settings = settings or load_settings()
    if api_key is None:
        from kapitsa.token import get_token

        api_key = get_token(settings.state_dir).token
    try:
        resolved = resolve_model(model, load_catalog(settings.catalog))
        name = resolved.entry.name if resolved.entry else resolved.display_name
        context, output = model_window(resolved)
    except KapitsaError:  # a model id only the server knows
        name, (context, output) = model, FALLBACK_LIMITS
    return LaunchContext(
        base_url=server_url.rstrip("/").removesuffix("/v1"),
        model_id=model,
        model_name=name,
        context_window=context,
        max_output=output,
        api_key=api_key or PLACEHOLDER_KEY,
        state_dir=settings.state_dir,
    )
