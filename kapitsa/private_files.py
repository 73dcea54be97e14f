"""Files only their owner may read: prompt token ids in the prefix cache, API keys in config backups.

Folders are made 0700 and files 0600 whatever the umask; a write is a temporary file in the same
folder, fsynced, renamed over the old one, then the folder is fsynced, so a crash leaves either the
old bytes or the new ones. A path that is a symlink (a dotfile manager's link) is written through to
its target, so the link stays a link.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
from pathlib import Path

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600


def make_private_dir(path: Path) -> Path:
    """Create `path` and its missing parents as 0700; an existing `path` open to others is tightened."""
    path = Path(path)
    missing = []
    folder = path
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    for created in reversed(missing):
        with contextlib.suppress(FileExistsError):
            created.mkdir(mode=PRIVATE_DIR)
        os.chmod(created, PRIVATE_DIR)  # mkdir's mode goes through the umask
    status = path.stat()
    if status.st_mode & 0o077 and status.st_uid == os.getuid():
        os.chmod(path, status.st_mode & 0o700 | PRIVATE_DIR)
    return path


def open_private(path: Path) -> int:
    """A new file opened for writing as 0600 (it must not exist yet)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE)


def sync_file(fd: int) -> None:
    """Flush a file's data to the disk itself; macOS's fsync stops at the drive's cache."""
    if sys.platform == "darwin":
        import fcntl

        with contextlib.suppress(OSError):
            fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
            return
    os.fsync(fd)


def sync_dir(folder: Path) -> None:
    """Make a rename inside `folder` durable (some filesystems cannot open a folder: then nothing)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def write_target(path: Path) -> Path:
    """Where a write of `path` lands: the file a symlink points to, else `path` itself."""
    path = Path(path)
    return Path(os.path.realpath(path)) if path.is_symlink() else path


def atomic_write(path: Path, data: bytes, *, mode: int = PRIVATE_FILE) -> Path:
    """Replace the file at `path` (its symlink's target, if it is one) with `data`; returns the file written.

    Args:
        path: the file, or a symlink to it (the link is kept).
        data: the new contents.
        mode: permissions of the new file.
    """
    target = write_target(path)
    if not target.parent.exists():
        make_private_dir(target.parent)
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")
    fd = open_private(tmp)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            sync_file(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    sync_dir(target.parent)
    return target
