"""The disk tier's budget covers the whole cache folder, every model's subfolder together.

Each model writes its checkpoints into its own subfolder of one cache root (disk.py). A budget per
subfolder would let the folder grow by a full budget for every model a user ever served; the
budget is the most the root holds, so the least recently used file of any model goes first. Files
of other models (and other processes) are seen through the file system: their modification time
is their last use, since the tier sets it on every write and load (`DiskTier._touch`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kapitsa.engine.cache.file import SUFFIX, TMP_PREFIX


@dataclass(slots=True, frozen=True)
class ForeignFile:
    """A checkpoint file this tier has no index entry for (another model's subfolder)."""

    path: Path
    nbytes: int
    last_used: float


def foreign_files(root: Path, own: Path) -> list[ForeignFile]:
    """The checkpoint files in `root`'s model subfolders other than `own`, least recently used
    first. Files being written (temporary names) and files that vanish while listed are left out:
    another process may be writing or evicting them."""
    found: list[ForeignFile] = []
    try:
        folders = [p for p in root.iterdir() if p.is_dir() and p != own]
    except OSError:
        return found
    for folder in folders:
        try:
            paths = list(folder.glob(f"*{SUFFIX}"))
        except OSError:
            continue
        for path in paths:
            if path.name.startswith(TMP_PREFIX):
                continue
            try:
                stat = path.stat()
            except OSError:
                continue
            found.append(ForeignFile(path, stat.st_size, stat.st_mtime))
    found.sort(key=lambda f: f.last_used)
    return found
