"""`kapitsa serve`: resolve settings, refuse unsafe binds before loading anything, load the model, serve."""

from __future__ import annotations

from kapitsa.errors import KapitsaError
from kapitsa.server.runner import check_bind, check_port_free, serve_forever
from kapitsa.server.settings import ServerSettings


def make_settings(
    *, model: str | None, host: str | None, port: int | None, speculative: str
) -> ServerSettings:
    """Flags override `KAPITSA_*` variables, which override the user's config file, then defaults."""
    from kapitsa.settings import load_settings

    user = load_settings()  # host and port from config.toml (or KAPITSA_HOST / KAPITSA_PORT)
    flags = {
        "model": model,
        "host": host or user.host,
        "port": port or user.port,
        "speculative": speculative if speculative != "none" else None,
    }
    return ServerSettings(**{k: v for k, v in flags.items() if v is not None})


def cmd_serve(
    *,
    model: str | None,
    host: str | None,
    port: int | None,
    speculative: str,
    draft: str | None = None,
    draft_tokens: int | None = None,
    tree: bool = False,
) -> None:
    settings = make_settings(model=model, host=host, port=port, speculative=speculative)
    check_bind(settings)
    _check_speculative(settings.speculative, draft)
    check_port_free(settings)
    from kapitsa.engine.inprocess import InProcessEngine
    from kapitsa.engine.options import EngineConfig
    from kapitsa.engine.speculative.factory import strategy_for
    from kapitsa.run_cmd import default_model, load_for_spec
    from kapitsa.settings import load_settings

    loaded = load_for_spec(settings.model or default_model())
    decode = strategy_for(
        settings.speculative, target_model=loaded.model, draft=draft, draft_tokens=draft_tokens, tree=tree
    )
    # The prefix cache's disk tier lives in kapitsa's state folder, so agent sessions survive restarts.
    config = EngineConfig(disk_cache_dir=load_settings().state_dir / "prefix-cache")
    client = InProcessEngine.from_loaded(loaded, config=config, decode=decode)
    try:
        serve_forever(client, settings)
    finally:
        client.close()


def _check_speculative(mode: str, draft: str | None) -> None:
    """Refuse modes `serve` cannot set up before spending minutes loading weights."""
    from kapitsa.engine.speculative.factory import MODES

    if mode not in MODES:
        raise KapitsaError(f"unknown speculative mode {mode!r}; choose one of {', '.join(MODES)}")
    if mode in ("draft", "block") and not draft:
        raise KapitsaError(f"--speculative {mode} needs --draft PATH (a drafter checkpoint)")
