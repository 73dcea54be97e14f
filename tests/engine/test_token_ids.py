"""The per-step views of a sequence's tokens: `TokenIds` (prompt + output, no copy) and drafters'
O(1) extension check (`new_tokens`)."""

from __future__ import annotations

import pytest

from kapitsa.engine.runner.sequence import TokenIds
from kapitsa.engine.speculative.draft_model import DraftModelDrafter
from kapitsa.engine.speculative.drafter import new_tokens
from kapitsa.engine.speculative.ngram import NGramDrafter


def test_token_ids_reads_like_the_concatenated_list() -> None:
    prompt, output = [1, 2, 3, 4], [5, 6]
    view, whole = TokenIds(prompt, output), prompt + output
    assert len(view) == 6 and list(view) == whole and bool(TokenIds([], [])) is False
    for index in range(-6, 6):
        assert view[index] == whole[index]
    for sl in (slice(None), slice(4, None), slice(1, 3), slice(2, 5), slice(-2, None), slice(None, None, 2)):
        assert view[sl] == whole[sl], sl
    with pytest.raises(IndexError):
        view[6]
    output.append(7)  # a view, not a copy: it sees the output grow
    assert view[-1] == 7 and len(view) == 7


def test_new_tokens_accepts_extensions_only() -> None:
    assert new_tokens([1, 2, 3, 4], [1, 2]) == [3, 4]
    assert new_tokens([1, 2], [1, 2]) == []
    assert new_tokens([1, 2, 3], []) == [1, 2, 3]
    assert new_tokens([1, 2], [1, 2, 3]) is None  # shorter than what is known
    assert new_tokens([9, 2, 3], [1, 2]) is None  # another context
    assert new_tokens([1, 5, 3], [1, 2]) is None
    assert new_tokens(TokenIds([1, 2], [3]), [1, 2]) == [3]


def test_ngram_drafter_follows_a_growing_view_and_resets_on_another_context(monkeypatch) -> None:
    resets = []
    reset = NGramDrafter.reset
    monkeypatch.setattr(NGramDrafter, "reset", lambda self, ctx: resets.append(len(ctx)) or reset(self, ctx))
    prompt, output = [7, 8, 9, 1, 2, 7, 8], []
    drafter = NGramDrafter()
    view = TokenIds(prompt, output)
    assert drafter.propose(view, 2).tokens == (9, 1)
    output += [9, 1]
    assert drafter.propose(view, 2).tokens == (2, 7)
    assert resets == []  # the index took the new tokens only
    assert drafter.propose([5, 6, 5, 6], 1).tokens == (5,)  # not an extension: rebuilt from scratch
    assert resets == [4]


def test_draft_model_catches_up_on_new_tokens_only(monkeypatch) -> None:
    from engine_standins import tiny_model

    drafter = DraftModelDrafter(tiny_model("qwen3_5"))
    fed = []
    real = drafter.model

    class Spy:
        def __call__(self, inputs, cache):
            fed.append(inputs.shape[1])
            return real(inputs, cache)

        def __getattr__(self, name):
            return getattr(real, name)

    drafter.model = Spy()
    prompt, output = [3, 4, 5, 6], []
    view = TokenIds(prompt, output)
    drafter.propose(view, 2)
    output += [7, 8]
    drafter.propose(view, 2)
    drafter.propose([9, 9, 9], 1)  # another context: starts over
    assert fed[0] == 4 and 2 in fed[1:] and 3 in fed
    assert drafter.fed == [9, 9, 9]
