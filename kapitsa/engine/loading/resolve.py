"""From a parsed model reference (`~/models/x`, `Qwen/Qwen3.5-27B`, `org/repo:4bit`, `x.gguf`; see
model_ref.py) to a path on disk. Repo ids are looked up in the standard Hugging Face cache; nothing
is downloaded."""

from __future__ import annotations

import os
import re
from pathlib import Path

from kapitsa.engine.loading.model_ref import ModelRef, is_repo_id, parse_model_ref
from kapitsa.errors import ModelNotFound, NotDownloaded

__all__ = ["ModelRef", "hf_hub_cache", "parse_model_ref", "pick_gguf", "resolve_repo_id", "resolve_source"]

_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def hf_hub_cache() -> Path:
    """The Hugging Face hub cache folder, honouring HF_HUB_CACHE / HF_HOME / XDG_CACHE_HOME."""
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(variable):
            return Path(os.environ[variable]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    cache_root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache_root.expanduser() / "huggingface" / "hub"


def _snapshot(repo_folder: Path, revision: str) -> Path | None:
    ref = repo_folder / "refs" / revision
    if ref.is_file():
        commit = ref.read_text().strip()
    elif _COMMIT.match(revision):
        commit = revision
    else:
        return None
    snapshot = repo_folder / "snapshots" / commit
    return snapshot if snapshot.is_dir() else None


def resolve_repo_id(repo_id: str, revision: str = "main", *, cache: Path | None = None) -> Path:
    """The snapshot folder of `repo_id` in the Hugging Face cache.

    Raises:
        ModelNotFound: the repo (or that revision of it) is not in the cache.
    """
    cache = cache or hf_hub_cache()
    repo_folder = cache / f"models--{repo_id.replace('/', '--')}"
    if not repo_folder.is_dir():
        raise NotDownloaded(
            f"{repo_id} is not downloaded yet (looked in {cache}); get it with `kapitsa pull {repo_id}`",
            ref=repo_id,
        )
    snapshot = _snapshot(repo_folder, revision)
    if snapshot is None and revision == "main":  # no refs/main: a cache filled by commit hash
        snapshots = sorted((repo_folder / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime)
        snapshot = snapshots[-1] if snapshots else None
    if snapshot is None:
        raise ModelNotFound(f"revision {revision!r} of {repo_id} is not in the Hugging Face cache ({cache})")
    return snapshot


def resolve_source(ref: ModelRef) -> Path:
    """A local file or folder for `ref.source`: an existing path, else a cached repo id."""
    path = Path(ref.source).expanduser()
    if path.exists():
        return path.resolve()
    if is_repo_id(ref.source):
        return resolve_repo_id(ref.source, ref.revision)
    raise ModelNotFound(f"no model at {ref.source!r}: not a file or folder, and not a Hugging Face repo id")


def pick_gguf(folder: Path, variant: str | None) -> Path | None:
    """In a folder of GGUF files (a GGUF repo), the one matching `variant` (e.g. "Q4_K_M")."""
    files = sorted(folder.glob("*.gguf"))
    if not files:
        return None
    if variant:
        matches = [f for f in files if variant.lower() in f.name.lower()]
    else:
        matches = files if len(files) == 1 else []
    if len(matches) == 1:
        return matches[0]
    names = ", ".join(f.name for f in files)
    wanted = f"matching {variant!r}" if variant else "(several present)"
    raise ModelNotFound(
        f"cannot choose a .gguf file {wanted} in {folder}: {names}; add `:TAG` or pass the file"
    )
