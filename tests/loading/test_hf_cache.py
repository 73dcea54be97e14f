"""Repo ids resolve in a Hugging Face cache laid out as huggingface_hub lays it out (blobs +
snapshot symlinks + refs), without any network."""

from __future__ import annotations

import hashlib
import shutil

import pytest

from kapitsa.engine.loading.loader import load_model
from kapitsa.engine.loading.model_ref import parse_model_ref
from kapitsa.engine.loading.resolve import hf_hub_cache
from kapitsa.errors import CheckpointError, ModelNotFound

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _cache_repo(cache, repo_id, folder, commit=COMMIT, write_ref=True):
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for file in folder.iterdir():
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copy(file, blob)
        (snapshot / file.name).symlink_to(f"../../blobs/{blob.name}")
    if write_ref:
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(commit)
    return repo


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "hf-home"
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(root))
    return root / "hub"


def test_cache_location_follows_the_environment(cache, monkeypatch, tmp_path):
    assert hf_hub_cache() == cache
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert hf_hub_cache() == tmp_path / "elsewhere"


def test_repo_id_loads_from_the_cache(cache, tiny):
    _cache_repo(cache, "Qwen/Tiny-Qwen3.5", tiny("qwen3_5", shards=2))
    loaded = load_model("Qwen/Tiny-Qwen3.5")
    assert loaded.info.id == "Qwen/Tiny-Qwen3.5"
    assert loaded.path.name == COMMIT
    assert load_model("Qwen/Tiny-Qwen3.5:8bit").info.quantization == "8bit"
    assert load_model(f"Qwen/Tiny-Qwen3.5@{COMMIT}").info.id == "Qwen/Tiny-Qwen3.5"


def test_cache_without_refs_uses_the_snapshot(cache, tiny):
    _cache_repo(cache, "nvidia/Tiny-Nemotron", tiny("nemotron_h"), write_ref=False)
    assert load_model("nvidia/Tiny-Nemotron").info.family == "nemotron_h"


def test_repo_not_in_cache_says_how_to_get_it(cache):
    with pytest.raises(ModelNotFound, match="not downloaded yet.*`kapitsa pull org/missing`"):
        load_model("org/missing")


def test_unknown_revision(cache, tiny):
    _cache_repo(cache, "Qwen/Tiny", tiny("qwen3_5"))
    with pytest.raises(ModelNotFound, match="revision 'v2'"):
        load_model("Qwen/Tiny@v2")


def test_interrupted_download_is_reported(cache, tiny):
    repo = _cache_repo(cache, "Qwen/Partial", tiny("qwen3_5", shards=2))
    blob = (repo / "snapshots" / COMMIT / "model-00001-of-00002.safetensors").resolve()
    blob.unlink()  # the symlink now dangles, as after an interrupted download
    with pytest.raises(CheckpointError, match="incomplete.*interrupted"):
        load_model("Qwen/Partial")


@pytest.mark.parametrize(
    ("spec", "source", "quantization", "variant", "revision"),
    [
        ("Qwen/Qwen3.5-27B", "Qwen/Qwen3.5-27B", None, None, "main"),
        ("Qwen/Qwen3.5-27B:4bit", "Qwen/Qwen3.5-27B", "4bit", None, "main"),
        ("Qwen/Qwen3.5-27B:BF16", "Qwen/Qwen3.5-27B", "bf16", None, "main"),
        ("unsloth/Qwen3.5-27B-GGUF:Q4_K_M", "unsloth/Qwen3.5-27B-GGUF", None, "Q4_K_M", "main"),
        ("org/repo@abc:6bit", "org/repo", "6bit", None, "abc"),
        ("/models/x:mxfp4", "/models/x", "mxfp4", None, "main"),
        ("C:\\models\\x", "C:\\models\\x", None, None, "main"),
    ],
)
def test_model_ref_parsing(spec, source, quantization, variant, revision):
    ref = parse_model_ref(spec)
    assert (ref.source, ref.quantization, ref.variant, ref.revision) == (
        source,
        quantization,
        variant,
        revision,
    )


def test_an_existing_path_with_a_colon_is_not_split(tmp_path):
    folder = tmp_path / "models:v2"
    folder.mkdir()
    assert parse_model_ref(str(folder)).source == str(folder)
