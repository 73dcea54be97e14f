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


def cmd_serve(*, model: str | None, host: str | None, port: int | None, speculative: str) -> None:
    settings = make_settings(model=model, host=host, port=port, speculative=speculative)
    check_bind(settings)
    _check_speculative(settings.speculative)
    check_port_free(settings)
    from kapitsa.engine.inprocess import InProcessEngine
    from kapitsa.engine.speculative.factory import make_decode_strategy
    from kapitsa.run_cmd import default_model, load_for_spec

    loaded = load_for_spec(settings.model or default_model())
    decode = make_decode_strategy(settings.speculative, target_model=loaded.model)
    client = InProcessEngine.from_loaded(loaded, decode=decode)
    try:
        serve_forever(client, settings)
    finally:
        client.close()


def _check_speculative(mode: str) -> None:
    """Refuse modes `serve` cannot set up before spending minutes loading weights."""
    from kapitsa.engine.speculative.factory import MODES

    if mode not in MODES:
        raise KapitsaError(f"unknown speculative mode {mode!r}; choose one of {', '.join(MODES)}")
    if mode in ("draft", "block"):
        raise KapitsaError(
            f"--speculative {mode} needs a drafter checkpoint, which `kapitsa serve` cannot take yet; "
            "use ngram, mtp or auto"
        )
