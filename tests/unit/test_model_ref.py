"""One model-reference grammar: the catalog and the loader read `source[@revision][:tag]` alike."""

from __future__ import annotations

import pytest

from kapitsa.catalog import load_catalog, resolve_model
from kapitsa.engine.loading.model_ref import QUANTIZATIONS, is_repo_id, parse_model_ref
from kapitsa.errors import ModelNotFound


def test_the_grammar_knows_every_quantization_the_loader_does() -> None:
    from kapitsa.engine.loading.quantize import QUANT_SPECS

    assert set(QUANT_SPECS) == QUANTIZATIONS


@pytest.mark.parametrize(
    ("spec", "source", "tag"),
    [
        ("27b", "27b", None),
        ("27b:6bit", "27b", "6bit"),
        ("27b:6BIT", "27b", "6bit"),  # quantizations are lowercased, for the catalog too
        ("4b:optiq-4bit", "4b", "optiq-4bit"),  # a catalog quant that is no loader quantization
        ("unsloth/Qwen3.5-27B-GGUF:Q4_K_M", "unsloth/Qwen3.5-27B-GGUF", "Q4_K_M"),
        ("~/models/x:bf16", "~/models/x", "bf16"),
    ],
)
def test_the_tag_is_what_follows_the_last_colon(spec: str, source: str, tag: str | None) -> None:
    ref = parse_model_ref(spec)
    assert (ref.source, ref.tag) == (source, tag)


@pytest.mark.parametrize("spec", ["", "   ", ":4bit"])
def test_an_empty_name_is_refused(spec: str) -> None:
    with pytest.raises(ModelNotFound, match="empty model name"):
        parse_model_ref(spec)


def test_catalog_quants_come_from_the_same_tag() -> None:
    catalog = load_catalog()
    six = resolve_model("27b:6bit", catalog)
    assert six.quant is not None and six.quant.name == "6bit" and six.display_name == "27b:6bit"
    with pytest.raises(ModelNotFound, match="empty model name"):
        resolve_model(":6bit", catalog)


@pytest.mark.parametrize(
    ("text", "is_repo"), [("Qwen/Qwen3.5-27B", True), ("./a/b", False), ("~/a", False), ("a", False)]
)
def test_repo_ids(text: str, is_repo: bool) -> None:
    assert is_repo_id(text) is is_repo
