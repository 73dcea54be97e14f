"""Build the decode strategy for a `--speculative` mode."""

from __future__ import annotations

from kapitsa.engine.decode import DecodeStrategy, PlainDecode
from kapitsa.engine.speculative.decoder import SpeculativeDecode
from kapitsa.engine.speculative.draft_model import DraftModelDrafter
from kapitsa.engine.speculative.ngram import NGramDrafter
from kapitsa.errors import InvalidRequest

MODES = ("none", "ngram", "mtp", "draft", "block", "auto")


def make_decode_strategy(
    mode: str,
    *,
    draft_model=None,  # noqa: ANN001 - a loaded kapitsa model, for mode "draft"
    draft_tokens: int | None = None,
    tree: bool = False,
) -> DecodeStrategy:
    """The decode strategy for `mode`.

    "auto" drafts with the draft model when one is given, else with n-gram lookup (no model, and
    the adaptive controller turns it off while nothing matches).
    """
    if mode not in MODES:
        raise InvalidRequest(f"unknown speculative mode {mode!r}; choose one of {', '.join(MODES)}")
    if tree:
        raise InvalidRequest("tree verification is not available in this build; use chains (--no-tree)")
    if mode == "none":
        return PlainDecode()
    max_draft = draft_tokens or 8
    if mode == "auto":
        mode = "draft" if draft_model is not None else "ngram"
    if mode == "ngram":
        return SpeculativeDecode(NGramDrafter, name="ngram", max_draft=max_draft)
    if mode == "draft":
        if draft_model is None:
            raise InvalidRequest(
                "--speculative draft needs --draft MODEL (a small model with the same tokenizer)"
            )
        return SpeculativeDecode(lambda: DraftModelDrafter(draft_model), name="draft", max_draft=max_draft)
    raise InvalidRequest(f"--speculative {mode} is not available in this build; use ngram, draft or auto")
