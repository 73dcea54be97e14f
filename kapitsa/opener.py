"""Opening an engine for a model reference: the one place `kapitsa run`, `serve`, `bench` and the TUI
get theirs, so every surface resolves references, caches prompts and speculates the same way.

The engine is imported inside the functions (it loads MLX); an engine missing from this build is a
`NotBuilt` error that says so.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

from kapitsa.engine.options import DEFAULT_SPECULATIVE, EngineConfig, KernelOptions
from kapitsa.errors import InvalidRequest, KapitsaError, ModelNotFound, NotBuilt, NotDownloaded
from kapitsa.settings import KapitsaSettings, load_settings

if TYPE_CHECKING:
    from kapitsa.engine.inprocess import InProcessEngine
    from kapitsa.engine.loading.loader import LoadedModel


def open_engine(
    ref: str | None,
    *,
    speculative: str = DEFAULT_SPECULATIVE,
    draft: str | None = None,
    draft_tokens: int | None = None,
    tree: bool = False,
    settings: KapitsaSettings | None = None,
) -> InProcessEngine:
    """Load a model and start its engine thread; the caller closes it (`contextlib.closing`).

    Args:
        ref: a catalog alias (`27b`, `27b:6bit`, `demo`), folder, .gguf file or cached HF repo id;
            None: the settings' default model.
        speculative: the `--speculative` mode (factory.MODES); `draft`, `draft_tokens` and `tree`
            are its `--draft`, `--draft-tokens` and `--tree` flags.
        settings: the user settings (default: read them); the disk tier lives in their state folder.
    Returns:
        The running engine, an `EngineClient` with a `close()`.
    Raises:
        KapitsaError: the reference, the flags or the checkpoint cannot be opened.
    """
    settings = settings or load_settings()
    check_speculation(speculative, draft)
    config = engine_config(settings)
    with _engine_required():
        from kapitsa.engine.inprocess import InProcessEngine
        from kapitsa.engine.speculative.factory import strategy_for
    loaded = load_for_ref(ref, settings=settings)
    decode = strategy_for(
        speculative,
        target_model=loaded.model,
        draft=draft,
        draft_tokens=draft_tokens,
        tree=tree,
        kernels=config.kernels,  # a draft model runs the kernels the target does
    )
    return InProcessEngine.from_loaded(loaded, config=config, decode=decode)


def engine_config(settings: KapitsaSettings) -> EngineConfig:
    """The engine's options: the prefix cache with its disk tier, kernels from the `KAPITSA_*` lab variables."""
    try:
        kernels = KernelOptions.from_environ(os.environ)  # the one read of the environment
    except ValueError as err:
        raise InvalidRequest(f"kernel options: {err}") from err
    # The disk tier lives in kapitsa's state folder, so a prompt cached by one run or server serves the next.
    return EngineConfig(disk_cache_dir=settings.state_dir / "prefix-cache", kernels=kernels)


def load_for_ref(ref: str | None, *, settings: KapitsaSettings | None = None) -> LoadedModel:
    """Load a catalog alias ("27b", "27b:6bit", "demo"), a folder, a .gguf file or a cached HF repo id."""
    from kapitsa.catalog import is_alias, load_catalog, resolve_model

    settings = settings or load_settings()
    ref = ref or settings.default_model
    with _engine_required():
        from kapitsa.engine.loading.loader import load_model
    catalog = load_catalog(settings.catalog)
    if not is_alias(ref, catalog):
        try:
            return load_model(ref)  # load_model handles paths, repo ids and ":4bit"-style tags
        except NotDownloaded:
            raise
        except ModelNotFound:
            resolve_model(
                ref, catalog
            )  # neither a path nor a repo id: the catalog's message, naming its aliases
            raise
    resolved = resolve_model(ref, catalog)
    source = resolved.path if resolved.kind == "path" else resolved.repo_id
    try:
        return load_model(str(source), model_id=resolved.display_name)
    except NotDownloaded:
        raise NotDownloaded(
            f"{ref} ({resolved.repo_id}) is not downloaded yet: run `kapitsa pull {ref}`", ref=ref
        ) from None


def check_speculation(mode: str, draft: str | None) -> None:
    """Refuse speculative flags that cannot be set up, before minutes of loading weights."""
    with _engine_required():
        from kapitsa.engine.speculative.factory import MODES

    if mode not in MODES:
        raise KapitsaError(f"unknown speculative mode {mode!r}; choose one of {', '.join(MODES)}")
    if mode in ("draft", "block") and not draft:
        raise KapitsaError(f"--speculative {mode} needs --draft PATH (a drafter checkpoint)")


@contextlib.contextmanager
def _engine_required() -> Iterator[None]:
    """Around the engine's imports only: a build without it (or without MLX) says so."""
    try:
        yield
    except ImportError as err:
        raise NotBuilt(f"the in-process engine is not available in this build ({err})") from err
