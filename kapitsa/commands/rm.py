"""`kapitsa rm`: delete a downloaded model from the Hugging Face cache."""

from __future__ import annotations

from kapitsa.catalog import load_catalog
from kapitsa.settings import load_settings
from kapitsa.units import format_bytes


def cmd_rm(ref: str) -> None:
    from kapitsa import hub

    settings = load_settings()
    removed = hub.remove(ref, catalog=load_catalog(settings.catalog))
    print(f"removed {removed.repo_id}, freed {format_bytes(removed.freed_bytes)}")
