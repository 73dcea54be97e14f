"""kapitsa pull / ls / rm against a fake hub on 127.0.0.1 (never the real one)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from fake_hub import FakeHub, FakeRepo
from huggingface_hub import constants

from kapitsa import hub
from kapitsa.catalog import load_catalog
from kapitsa.errors import CheckpointError, KapitsaError, ModelNotFound

REPO = "test-org/Tiny-Model-4bit"
WEIGHTS = bytes(range(256)) * 400  # 100 KiB: an LFS file
FILES = {"config.json": b'{"model_type": "qwen3_5"}', "model.safetensors": WEIGHTS, "tokenizer.json": b"{}"}


@pytest.fixture
def fake_hub(monkeypatch: pytest.MonkeyPatch):
    fake = FakeHub(repos={REPO: FakeRepo(dict(FILES))})
    url = fake.start()
    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    yield fake
    fake.stop()


@pytest.fixture
def catalog():
    return load_catalog(
        {
            "tiny": {
                "name": "Tiny",
                "model_type": "qwen3_5",
                "params_b": 0.0001,
                "active_params_b": 0.0001,
                "context_length": 4096,
                "max_output": 1024,
                "hidden_size": 64,
                "vocab_size": 256,
                "attention_layers": 1,
                "num_kv_heads": 1,
                "head_dim": 16,
                "quants": {"4bit": REPO},
            }
        }
    )


def test_pull_downloads_verifies_and_reports_progress(fake_hub: FakeHub, catalog, tmp_path: Path) -> None:
    seen: list[hub.PullProgress] = []
    result = hub.pull("tiny", catalog=catalog, cache_dir=tmp_path, on_progress=seen.append)
    assert result.repo_id == REPO and result.commit == fake_hub.repos[REPO].commit
    assert {p.name for p in result.path.iterdir()} == set(FILES)
    assert (result.path / "model.safetensors").read_bytes() == WEIGHTS
    assert result.downloaded_bytes == result.num_bytes == sum(map(len, FILES.values()))
    assert seen[-1].bytes_done == seen[-1].bytes_total == result.num_bytes
    assert all(a.bytes_done <= b.bytes_done for a, b in zip(seen, seen[1:], strict=False))


def test_second_pull_is_served_from_the_cache(fake_hub: FakeHub, catalog, tmp_path: Path) -> None:
    hub.pull("tiny", catalog=catalog, cache_dir=tmp_path)
    fake_hub.requests.clear()
    again = hub.pull("tiny", catalog=catalog, cache_dir=tmp_path)
    assert again.downloaded_bytes == 0
    assert not [r for r in fake_hub.requests if r[0] == "GET" and "/resolve/" in r[1]]


def test_interrupted_download_resumes_in_the_same_pull(fake_hub: FakeHub, catalog, tmp_path: Path) -> None:
    fake_hub.cut_after["model.safetensors"] = 28_672
    result = hub.pull("tiny", catalog=catalog, cache_dir=tmp_path)
    assert (result.path / "model.safetensors").read_bytes() == WEIGHTS
    ranges = [r[2] for r in fake_hub.requests if r[0] == "GET" and r[1].endswith("model.safetensors")]
    assert ranges == [None, "bytes=28672-"]


def test_failed_pull_resumes_on_the_next_pull(fake_hub: FakeHub, catalog, tmp_path: Path) -> None:
    fake_hub.cut_after["model.safetensors"] = 40_960
    fake_hub.fail_gets["model.safetensors"] = 1  # the automatic retry fails: the pull gives up
    with pytest.raises(KapitsaError, match="Run the pull again to resume"):
        hub.pull("tiny", catalog=catalog, cache_dir=tmp_path)
    partial = list(tmp_path.rglob("*.incomplete"))
    assert len(partial) == 1 and partial[0].stat().st_size == 40_960
    fake_hub.requests.clear()
    result = hub.pull("tiny", catalog=catalog, cache_dir=tmp_path)
    assert (result.path / "model.safetensors").read_bytes() == WEIGHTS
    gets = [r for r in fake_hub.requests if r[0] == "GET" and r[1].endswith("model.safetensors")]
    assert [r[2] for r in gets] == ["bytes=40960-"]
    assert not list(tmp_path.rglob("*.incomplete"))


def test_corrupt_file_is_rejected_and_deleted(fake_hub: FakeHub, catalog, tmp_path: Path) -> None:
    fake_hub.corrupt.add("model.safetensors")
    with pytest.raises(CheckpointError, match="failed verification"):
        hub.pull("tiny", catalog=catalog, cache_dir=tmp_path)
    assert not [p for p in tmp_path.rglob("model.safetensors") if p.exists()]
    fake_hub.corrupt.clear()
    assert (
        hub.pull("tiny", catalog=catalog, cache_dir=tmp_path).path / "model.safetensors"
    ).read_bytes() == WEIGHTS


def test_unknown_repo_is_model_not_found(fake_hub: FakeHub, catalog, tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound, match="not found"):
        hub.pull("test-org/missing", catalog=catalog, cache_dir=tmp_path)


def test_offline_mode_uses_the_cache_or_says_why(
    fake_hub: FakeHub, catalog, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelNotFound, match="HF_HUB_OFFLINE"):
        hub.pull("tiny", catalog=catalog, cache_dir=tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    first = hub.pull("tiny", catalog=catalog, cache_dir=tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    fake_hub.requests.clear()
    assert hub.pull("tiny", catalog=catalog, cache_dir=tmp_path).path == first.path
    assert fake_hub.requests == []


def test_ls_and_rm(fake_hub: FakeHub, catalog, tmp_path: Path) -> None:
    assert hub.list_local(catalog=catalog, cache_dir=tmp_path) == []
    hub.pull("tiny", catalog=catalog, cache_dir=tmp_path)
    [local] = hub.list_local(catalog=catalog, cache_dir=tmp_path)
    assert local.repo_id == REPO and local.refs == ("tiny",) and local.size_bytes >= len(WEIGHTS)
    removed = hub.remove("tiny", catalog=catalog, cache_dir=tmp_path)
    assert removed.freed_bytes >= len(WEIGHTS)
    assert hub.list_local(catalog=catalog, cache_dir=tmp_path) == []
    with pytest.raises(ModelNotFound):
        hub.remove("tiny", catalog=catalog, cache_dir=tmp_path)


def test_allow_patterns_pick_one_file(fake_hub: FakeHub, tmp_path: Path) -> None:
    cat = load_catalog(
        {
            "g": {
                "name": "G",
                "params_b": 1,
                "active_params_b": 1,
                "context_length": 8,
                "max_output": 8,
                "hidden_size": 8,
                "vocab_size": 8,
                "attention_layers": 1,
                "num_kv_heads": 1,
                "head_dim": 8,
                "quants": {"q8_0": {"repo": REPO, "allow_patterns": ["*.json"]}},
            }
        }
    )
    result = hub.pull("g", catalog=cat, cache_dir=tmp_path)
    assert {p.name for p in result.path.iterdir()} == {"config.json", "tokenizer.json"}
    assert os.environ["HF_ENDPOINT"].startswith("http://127.0.0.1:")


class Cancelled(Exception):
    pass


def test_cancel_from_the_progress_callback_keeps_the_partial(
    fake_hub: FakeHub, catalog, tmp_path: Path
) -> None:
    before = len(FILES["config.json"])  # files come in name order

    def cancel_midway(progress: hub.PullProgress) -> None:
        if progress.file_name == "model.safetensors" and progress.bytes_done - before >= 10_000:
            raise Cancelled  # what the TUI's cancel button does

    with pytest.raises(Cancelled):
        hub.pull("tiny", catalog=catalog, cache_dir=tmp_path, on_progress=cancel_midway)
    [partial] = [p.stat().st_size for p in tmp_path.rglob("*.incomplete")]
    assert 10_000 <= partial < len(WEIGHTS)
    fake_hub.requests.clear()
    result = hub.pull("tiny", catalog=catalog, cache_dir=tmp_path)
    assert (result.path / "model.safetensors").read_bytes() == WEIGHTS
    assert [r[2] for r in fake_hub.requests if r[1].endswith("model.safetensors")] == [f"bytes={partial}-"]


def test_unreachable_endpoint_is_a_clear_error(
    catalog, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once the socket closes
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with pytest.raises(KapitsaError, match="HF_ENDPOINT"):
        hub.pull("tiny", catalog=catalog, cache_dir=tmp_path)


def test_cli_pull_ls_rm(fake_hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from typer.testing import CliRunner

    from kapitsa.cli import app

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("KAPITSA_CONFIG", str(tmp_path / "none.toml"))
    runner = CliRunner()
    pulled = runner.invoke(app, ["pull", REPO], catch_exceptions=False)
    assert pulled.exit_code == 0 and "verified" in pulled.stdout and "downloaded" in pulled.stdout
    listed = json.loads(runner.invoke(app, ["ls", "--json"], catch_exceptions=False).stdout)
    assert [m["repo_id"] for m in listed] == [REPO]
    assert REPO in runner.invoke(app, ["ls"], catch_exceptions=False).stdout
    removed = runner.invoke(app, ["rm", REPO], catch_exceptions=False)
    assert removed.exit_code == 0 and "freed" in removed.stdout
    assert json.loads(runner.invoke(app, ["ls", "--json"], catch_exceptions=False).stdout) == []


def test_cli_pull_failure_is_one_error_line_and_exits_non_zero(
    fake_hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import sys

    from kapitsa import cli

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("KAPITSA_CONFIG", str(tmp_path / "none.toml"))
    fake_hub.cut_after["model.safetensors"] = len(WEIGHTS) // 2  # some bytes arrive, then the hub fails
    fake_hub.fail_gets["model.safetensors"] = 5
    monkeypatch.setattr(sys, "argv", ["kapitsa", "pull", REPO])
    with pytest.raises(SystemExit) as exited:
        cli.main()
    captured = capsys.readouterr()
    assert exited.value.code == 1 and captured.out == ""
    (line,) = captured.err.strip().splitlines()  # no progress bar left behind, no traceback
    assert line.startswith(f"error: HTTP 500 Internal Server Error while downloading {REPO}")
    assert "Run the pull again to resume" in line
