"""Merging into another program's JSON config: unrelated keys kept, concurrent writers survive,
restore is byte-for-byte when nobody touched the file since, kapitsa's records are private, and a
symlinked config stays a link."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from kapitsa.agents import pi
from kapitsa.agents.base import LaunchContext
from kapitsa.agents.config_files import ManagedFile, merge_json, restore
from kapitsa.errors import KapitsaError

ORIGINAL = b'{"providers":{"mine":{"baseUrl":"http://x","models":[{"id":"a"}]}},\n  "zeta": {"k": [1,2,3]}, "alpha": true}'


def _ctx(tmp_path: Path, model: str = "27b") -> LaunchContext:
    return LaunchContext(
        base_url="http://127.0.0.1:8484",
        model_id=model,
        model_name="Qwen",
        context_window=1000,
        max_output=100,
        api_key="k",
        state_dir=tmp_path / "state",
    )


def _managed(tmp_path: Path) -> ManagedFile:
    return ManagedFile(path=tmp_path / "pi" / "models.json", state_dir=tmp_path / "state" / "pi")


def test_merge_keeps_every_unrelated_key_and_the_file_mode(tmp_path: Path) -> None:
    managed = _managed(tmp_path)
    managed.path.parent.mkdir()
    managed.path.write_bytes(ORIGINAL)
    managed.path.chmod(0o640)
    merge_json(managed, pi.upsert_provider(_ctx(tmp_path)))
    merged = json.loads(managed.path.read_bytes())
    before = json.loads(ORIGINAL)
    assert merged["zeta"] == before["zeta"] and merged["alpha"] is True
    assert merged["providers"]["mine"] == before["providers"]["mine"]
    assert [m["id"] for m in merged["providers"]["kapitsa"]["models"]] == ["27b"]
    assert stat.S_IMODE(managed.path.stat().st_mode) == 0o640
    assert len(list((managed.state_dir / "backups").iterdir())) == 1


def test_second_model_is_added_and_same_model_replaced(tmp_path: Path) -> None:
    managed = _managed(tmp_path)
    merge_json(managed, pi.upsert_provider(_ctx(tmp_path, "27b")))
    merge_json(managed, pi.upsert_provider(_ctx(tmp_path, "bolt")))
    merge_json(managed, pi.upsert_provider(_ctx(tmp_path, "27b")))
    ids = [m["id"] for m in json.loads(managed.path.read_text())["providers"]["kapitsa"]["models"]]
    assert sorted(ids) == ["27b", "bolt"]


def test_a_concurrent_writer_is_not_lost(tmp_path: Path) -> None:
    managed = _managed(tmp_path)
    managed.path.parent.mkdir()
    managed.path.write_bytes(ORIGINAL)
    writes = []

    def someone_else_writes() -> None:
        if not writes:  # once, between kapitsa's read and its rename
            config = json.loads(managed.path.read_bytes())
            config["written_by_pi"] = "meanwhile"
            managed.path.write_text(json.dumps(config))
            writes.append(1)

    merge_json(managed, pi.upsert_provider(_ctx(tmp_path)), before_replace=someone_else_writes)
    merged = json.loads(managed.path.read_text())
    assert merged["written_by_pi"] == "meanwhile" and "kapitsa" in merged["providers"]


def test_restore_is_byte_for_byte(tmp_path: Path) -> None:
    managed = _managed(tmp_path)
    managed.path.parent.mkdir()
    managed.path.write_bytes(ORIGINAL)
    merge_json(managed, pi.upsert_provider(_ctx(tmp_path, "27b")))
    merge_json(managed, pi.upsert_provider(_ctx(tmp_path, "bolt")))
    assert "byte-for-byte" in restore(managed, pi.remove_managed)
    assert managed.path.read_bytes() == ORIGINAL
    assert "nothing to restore" in restore(managed, pi.remove_managed)


def test_restore_after_the_user_edited_keeps_their_edit(tmp_path: Path) -> None:
    managed = _managed(tmp_path)
    managed.path.parent.mkdir()
    managed.path.write_bytes(ORIGINAL)
    merge_json(managed, pi.upsert_provider(_ctx(tmp_path)))
    config = json.loads(managed.path.read_text())
    config["providers"]["kapitsa"]["models"].append({"id": "hand-added"})
    config["new_user_key"] = 1
    managed.path.write_text(json.dumps(config))
    assert "later edits kept" in restore(managed, pi.remove_managed)
    after = json.loads(managed.path.read_text())
    assert (
        after["new_user_key"] == 1 and after["providers"]["mine"] == json.loads(ORIGINAL)["providers"]["mine"]
    )
    assert [m["id"] for m in after["providers"]["kapitsa"]["models"]] == ["hand-added"]


def test_restore_removes_a_file_kapitsa_created(tmp_path: Path) -> None:
    managed = _managed(tmp_path)
    merge_json(managed, pi.upsert_provider(_ctx(tmp_path)))
    assert managed.path.exists()
    restore(managed, pi.remove_managed)
    assert not managed.path.exists()


def test_invalid_json_is_left_alone(tmp_path: Path) -> None:
    managed = _managed(tmp_path)
    managed.path.parent.mkdir()
    managed.path.write_text("{not json")
    with pytest.raises(KapitsaError, match="not valid JSON"):
        merge_json(managed, pi.upsert_provider(_ctx(tmp_path)))
    assert managed.path.read_text() == "{not json"


def test_a_file_that_never_settles_is_an_error(tmp_path: Path) -> None:
    managed = _managed(tmp_path)
    managed.path.parent.mkdir()
    managed.path.write_text("{}")
    counter = iter(range(100))

    def always_write() -> None:
        managed.path.write_text(json.dumps({"n": next(counter)}))

    with pytest.raises(KapitsaError, match="kept changing"):
        merge_json(managed, pi.upsert_provider(_ctx(tmp_path)), before_replace=always_write)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_records_and_backups_are_private(tmp_path: Path, open_umask) -> None:
    managed = _managed(tmp_path)
    managed.path.parent.mkdir()
    managed.path.write_bytes(ORIGINAL)
    merge_json(managed, pi.upsert_provider(_ctx(tmp_path, "27b")))
    merge_json(managed, pi.upsert_provider(_ctx(tmp_path, "bolt")))
    (backup, *_) = (managed.state_dir / "backups").iterdir()
    assert {_mode(p) for p in (managed.original, managed.last_written, backup)} == {0o600}
    assert _mode(managed.state_dir) == _mode(managed.state_dir / "backups") == 0o700


def test_a_new_config_file_is_private(tmp_path: Path, open_umask) -> None:
    managed = _managed(tmp_path)
    merge_json(managed, pi.upsert_provider(_ctx(tmp_path)))
    assert _mode(managed.path) == 0o600 and _mode(managed.path.parent) == 0o700


def test_a_symlinked_config_stays_a_link_through_merge_and_restore(tmp_path: Path) -> None:
    managed = _managed(tmp_path)
    dotfiles = tmp_path / "dotfiles"
    dotfiles.mkdir()
    target = dotfiles / "models.json"
    target.write_bytes(ORIGINAL)
    managed.path.parent.mkdir()
    managed.path.symlink_to(Path("..") / "dotfiles" / "models.json")  # relative, as dotfile managers make
    merge_json(managed, pi.upsert_provider(_ctx(tmp_path)))
    assert managed.path.is_symlink() and "kapitsa" in json.loads(target.read_text())["providers"]
    assert "byte-for-byte" in restore(managed, pi.remove_managed)
    assert managed.path.is_symlink() and target.read_bytes() == ORIGINAL
    assert [p.name for p in dotfiles.iterdir()] == ["models.json"]  # no temporary file left
