"""Safe edits of another program's JSON config: merge, atomic replace, backup, exact restore.

The merge re-reads the file just before replacing it and starts over when someone else wrote it in
between, so a concurrent writer's change is never lost. The file's bytes from before kapitsa's first
change are kept, so `restore` can put them back exactly when nobody has edited the file since. A
config that is a symlink (dotfile managers) is written through to its target, so it stays a link.
kapitsa's records hold the user's API keys: their folders are 0700 and their files 0600.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kapitsa.errors import KapitsaError
from kapitsa.private_files import PRIVATE_FILE, atomic_write, make_private_dir, write_target

KEEP_BACKUPS = 5
Transform = Callable[[dict[str, Any]], dict[str, Any]]


@dataclass(slots=True, frozen=True)
class ManagedFile:
    path: Path  # the other program's file
    state_dir: Path  # kapitsa's records about it: original bytes, last write, backups

    @property
    def original(self) -> Path:
        return self.state_dir / "original"

    @property
    def absent_marker(self) -> Path:
        return self.state_dir / "original.absent"

    @property
    def last_written(self) -> Path:
        return self.state_dir / "last-written.sha256"


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def _parse(path: Path, raw: bytes | None) -> dict[str, Any]:
    if raw is None or not raw.strip():
        return {}
    try:
        data = json.loads(raw)
    except ValueError as err:
        raise KapitsaError(
            f"{path} is not valid JSON ({err}); fix it or move it away, kapitsa will not overwrite it"
        ) from err
    if not isinstance(data, dict):
        raise KapitsaError(f"{path} does not hold a JSON object; kapitsa will not overwrite it")
    return data


def _replace_config(path: Path, data: bytes) -> None:
    """The other program's file (a symlink's target) replaced atomically, its permissions kept."""
    target = write_target(path)
    mode = target.stat().st_mode & 0o777 if target.exists() else PRIVATE_FILE
    atomic_write(path, data, mode=mode)


def _write_record(path: Path, data: bytes) -> None:
    make_private_dir(path.parent)
    atomic_write(path, data)


def _backup(managed: ManagedFile, raw: bytes) -> None:
    folder = make_private_dir(managed.state_dir / "backups")
    _write_record(folder / f"{managed.path.name}.{time.time_ns()}", raw)
    for old in sorted(folder.iterdir())[:-KEEP_BACKUPS]:
        old.unlink(missing_ok=True)


def _remember_original(managed: ManagedFile, raw: bytes | None) -> None:
    if managed.original.exists() or managed.absent_marker.exists():
        return
    if raw is None:
        _write_record(managed.absent_marker, b"")
    else:
        _write_record(managed.original, raw)


def merge_json(
    managed: ManagedFile,
    transform: Transform,
    *,
    attempts: int = 5,
    before_replace: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Apply `transform` to the file's JSON and write it back atomically.

    `before_replace` is a test hook run between computing the new content and re-checking the file.
    """
    for _ in range(attempts):
        raw = _read(managed.path)
        updated = transform(_parse(managed.path, raw))
        data = (json.dumps(updated, indent=2, ensure_ascii=False) + "\n").encode()
        if before_replace is not None:
            before_replace()
        if _read(managed.path) != raw:
            continue  # someone else wrote it meanwhile: merge again from their version
        if raw == data:
            return updated
        _remember_original(managed, raw)
        if raw is not None:
            _backup(managed, raw)
        _replace_config(managed.path, data)
        _write_record(managed.last_written, hashlib.sha256(data).hexdigest().encode())
        return updated
    raise KapitsaError(f"{managed.path} kept changing while kapitsa tried to update it; try again")


def restore(managed: ManagedFile, remove_managed: Transform) -> str:
    """Undo kapitsa's changes: the original bytes when the file is as kapitsa left it, else a surgical removal."""
    raw = _read(managed.path)
    if not managed.original.exists() and not managed.absent_marker.exists():
        return f"{managed.path}: nothing to restore"
    untouched = (
        raw is not None
        and managed.last_written.exists()
        and (hashlib.sha256(raw).hexdigest() == managed.last_written.read_text().strip())
    )
    if untouched and managed.absent_marker.exists():
        managed.path.unlink()
        message = f"{managed.path}: removed (it did not exist before kapitsa)"
    elif untouched:
        _replace_config(managed.path, managed.original.read_bytes())
        message = f"{managed.path}: restored byte-for-byte"
    else:
        merge_json(managed, remove_managed)
        message = f"{managed.path}: kapitsa's entries removed; your later edits kept"
    for record in (managed.original, managed.absent_marker, managed.last_written):
        record.unlink(missing_ok=True)
    return message
