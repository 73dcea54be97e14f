"""`kapitsa ls`: the models in the Hugging Face cache, with the catalog aliases that name them."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING

from kapitsa.catalog import load_catalog
from kapitsa.commands.output import print_json, terminal_console
from kapitsa.settings import load_settings
from kapitsa.units import format_bytes

if TYPE_CHECKING:
    from rich.table import Table

    from kapitsa.hub import LocalModel

EMPTY = "no models in the Hugging Face cache; try `kapitsa pull 4b`"


def cmd_ls(json_out: bool) -> None:
    from kapitsa import hub

    settings = load_settings()
    print_models(hub.list_local(catalog=load_catalog(settings.catalog)), json_out=json_out)


def print_models(models: list[LocalModel], *, json_out: bool) -> None:
    """JSON for `--json`; a rich table on a terminal; plain columns when piped."""
    if json_out:
        print_json([asdict(m) for m in models])
    elif not models:
        print(EMPTY)
    elif (console := terminal_console()) is not None:
        console.print(rich_table(models))
    else:
        print(render_text(models))


def _rows(models: list[LocalModel]) -> list[tuple[str, str, str]]:
    return [(m.repo_id, ", ".join(m.refs) or "-", format_bytes(m.size_bytes)) for m in models]


def render_text(models: list[LocalModel]) -> str:
    lines = [f"{'REPO':<56} {'ALIAS':<16} {'SIZE':>10}"]
    lines += [f"{repo:<56} {refs:<16} {size:>10}" for repo, refs, size in _rows(models)]
    return "\n".join(lines)


def rich_table(models: list[LocalModel]) -> Table:
    from rich.table import Table

    table = Table(header_style="bold")
    table.add_column("repo", style="cyan", no_wrap=True)
    table.add_column("alias")
    table.add_column("size", justify="right")
    for row in _rows(models):
        table.add_row(*row)
    return table
