"""Private state: folders 0700 and files 0600 whatever the umask; writes through a symlink keep it."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from kapitsa.private_files import atomic_write, make_private_dir

pytestmark = pytest.mark.usefixtures("open_umask")


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_missing_folders_are_made_private(tmp_path: Path) -> None:
    folder = make_private_dir(tmp_path / "state" / "prefix-cache")
    assert _mode(folder) == _mode(folder.parent) == 0o700


def test_an_existing_open_folder_is_tightened(tmp_path: Path) -> None:
    folder = tmp_path / "logs"
    folder.mkdir(mode=0o755)
    make_private_dir(folder)
    assert _mode(folder) == 0o700


def test_atomic_write_is_private_and_keeps_a_symlink(tmp_path: Path) -> None:
    target = tmp_path / "real.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    assert atomic_write(link, b"new") == target
    assert link.is_symlink() and target.read_text() == "new" and _mode(target) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "real.json"]
