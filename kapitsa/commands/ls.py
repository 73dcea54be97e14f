"""`kapitsa ls`: the models in the Hugging Face cache, with the catalog aliases that name them."""

from __future__ import annotations

from dataclasses import asdict

from kapitsa.catalog import load_catalog
from kapitsa.commands.output import gigabytes, print_json
from kapitsa.settings import load_settings


def cmd_ls(json_out: bool) -> None:
    from kapitsa import hub

    settings = load_settings()
    models = hub.list_local(catalog=load_catalog(settings.catalog))
    if json_out:
        print_json([asdict(m) for m in models])
        return
    if not models:
        print("no models in the Hugging Face cache; try `kapitsa pull 4b`")
        return
    print(f"{'REPO':<56} {'ALIAS':<16} {'SIZE':>10}")
    for m in models:
        print(f"{m.repo_id:<56} {', '.join(m.refs) or '-':<16} {gigabytes(m.size_bytes):>10}")
