"""The disk tier's budget covers the whole cache folder, every model's subfolder together.

Each model writes its checkpoints into its own subfolder of one cache root (disk.py). A budget per
subfolder would let the folder grow by a full budget for every model a user ever served; the
budget is the most the root holds, so the least recently used file of any model goes first. Files
of other models and other processes are seen through the file system, listed outside the tier's
lock: their modification time is their last use, since the tier sets it on every write and load
(`DiskTier._touch`).
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from kapitsa.engine.cache.file import SUFFIX


@dataclass(slots=True, frozen=True)
class ForeignFile:
    """A checkpoint file this tier has no index entry for (another model's, or another process's)."""

    path: Path
    nbytes: int
    last_used: float


# What the tier names its folders (a model key's digest) and files (a prefix's digest); anything
# else in the cache folder is not the tier's to count or delete.
_FOLDER = re.compile(r"[0-9a-f]{16}")
_FILE = re.compile(r"[0-9a-f]{32}" + re.escape(SUFFIX))


def is_tier_file(name: str) -> bool:
    """Whether a file name is one the tier gives a checkpoint (a prefix digest)."""
    return _FILE.fullmatch(name) is not None


def foreign_files(root: Path, known: Collection[Path] = ()) -> list[ForeignFile]:
    """The checkpoint files in `root`'s model folders other than `known` (the caller's own index:
    files another process wrote into the caller's folder count too), least recently used first.
    Files being written (temporary names) and files that vanish while listed are left out: another
    process may be writing or evicting them."""
    found: list[ForeignFile] = []
    try:
        folders = [p for p in root.iterdir() if _FOLDER.fullmatch(p.name) and p.is_dir()]
    except OSError:
        return found
    skip = set(known)
    for folder in folders:
        try:
            paths = [p for p in folder.iterdir() if is_tier_file(p.name) and p not in skip]
        except OSError:
            continue
        for path in paths:
            try:
                stat = path.stat()
            except OSError:
                continue
            found.append(ForeignFile(path, stat.st_size, stat.st_mtime))
    found.sort(key=lambda f: f.last_used)
    return found
