"""Where a request's images come from (server/images.py): file:// paths are read only as regular
files and only up to the size cap, so a hostile path cannot hold or exhaust the server."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from kapitsa.errors import InvalidRequest
from kapitsa.server import images


def _read(path: Path) -> bytes:
    return images._read_url(path.as_uri(), 0)


def test_a_regular_file_is_read(tmp_path: Path) -> None:
    (tmp_path / "a.png").write_bytes(b"\x89PNG fake")
    assert _read(tmp_path / "a.png") == b"\x89PNG fake"


def test_a_fifo_without_a_writer_is_refused_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    outcome: list[BaseException] = []
    reader = threading.Thread(target=lambda: _capture(outcome, fifo), daemon=True)
    reader.start()
    reader.join(5.0)
    assert not reader.is_alive(), "reading a FIFO blocked"
    assert isinstance(outcome[0], InvalidRequest) and "not a regular file" in str(outcome[0])


def _capture(outcome: list[BaseException], path: Path) -> None:
    try:
        _read(path)
    except BaseException as err:  # noqa: BLE001 - the test inspects whatever came out
        outcome.append(err)


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="no /dev/zero")
def test_an_endless_device_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="not a regular file"):
        _read(Path("/dev/zero"))


def test_a_file_past_the_cap_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(images, "MAX_IMAGE_BYTES", 16)
    (tmp_path / "big.png").write_bytes(b"x" * 17)
    (tmp_path / "ok.png").write_bytes(b"x" * 16)
    with pytest.raises(InvalidRequest, match="larger than 16 bytes"):
        _read(tmp_path / "big.png")
    assert _read(tmp_path / "ok.png") == b"x" * 16


def test_a_missing_file_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="cannot read .*missing.png"):
        _read(tmp_path / "missing.png")


def test_network_urls_are_refused() -> None:
    with pytest.raises(InvalidRequest, match="does not fetch images from the network"):
        images._read_url("https://example.com/a.png", 0)
