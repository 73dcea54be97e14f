"""`kapitsa pull`: download a model into the Hugging Face cache, with a progress bar on stderr."""

from __future__ import annotations

from typing import Any

from kapitsa.catalog import load_catalog
from kapitsa.settings import KapitsaSettings, load_settings
from kapitsa.units import format_bytes


def cmd_pull(ref: str) -> None:
    result = pull_with_progress(ref, load_settings())
    if not result.commit:  # a local folder or the packaged demo: nothing to download
        print(f"{ref} is on disk already: {result.path}")
        return
    fetched = (
        f"downloaded {format_bytes(result.downloaded_bytes)}"
        if result.downloaded_bytes
        else "already downloaded"
    )
    print(
        f"{result.repo_id} @ {result.commit[:12]}: {result.num_files} files, "
        f"{format_bytes(result.num_bytes)}, verified, {fetched}\n{result.path}"
    )


def pull_with_progress(ref: str, settings: KapitsaSettings) -> Any:
    """`hub.pull` with a rich progress bar on stderr."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    from kapitsa import hub

    catalog = load_catalog(settings.catalog)
    console = Console(stderr=True)
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        console=console,
        transient=True,  # on success the summary replaces it; on failure the one `error:` line does
        disable=not console.is_terminal,  # a log or pipe gets the result lines only
    ) as bar:
        task = bar.add_task(f"pulling {ref}", total=None)

        def on_progress(p: hub.PullProgress) -> None:
            bar.update(
                task,
                total=p.bytes_total,
                completed=p.bytes_done,
                description=f"{p.repo_id} [{p.files_done + 1}/{p.files_total}] {p.file_name}",
            )

        return hub.pull(ref, catalog=catalog, on_progress=on_progress)
