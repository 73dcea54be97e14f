"""Drafting with the checkpoint's own multi-token-prediction head (Qwen3.5 / Qwen3-Next `mtp.*`).

The head predicts token t+2 from the target's (final-normed) hidden state at t and the embedding
of token t+1. After each verify the strategy hands the drafter the hidden rows of the positions
it kept and the tokens emitted there; the next proposal folds those pairs into the head's own KV
cache (one forward) and reads the first draft off its last row. Deeper drafts feed the head its
own output (depth <= 3: the head was trained for one step) and are then dropped from its cache.

The head's KV covers the prompt's last positions (the prefill keeps their normed hidden states:
runner/prompt_tail.py), so the first decode step drafts too, and every position decoded since.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from kapitsa.engine.speculative.drafter import Draft

MAX_DEPTH = 3


class MTPDrafter:
    name = "mtp"
    needs_hidden = True

    def __init__(self, model) -> None:  # noqa: ANN001 - a kapitsa Qwen model with MTP weights
        if getattr(model, "mtp", None) is None:
            raise ValueError("this checkpoint ships no MTP weights")
        self.model = model
        self.cache = model.make_mtp_cache(1)
        self._pending: tuple[mx.array, list[int]] | None = None  # hidden [n, H], tokens emitted there

    def observe(self, new_tokens: Sequence[int]) -> None:
        pass

    def after_verify(self, hidden: mx.array, tokens: Sequence[int], taps: dict[int, mx.array]) -> None:
        """`hidden[j]` (final-normed) is the target's state whose next token was `tokens[j]`."""
        self._pending = (hidden, list(tokens))

    def propose(self, context: Sequence[int], max_tokens: int) -> Draft:
        if self._pending is None:
            return Draft(())
        hidden, tokens = self._pending
        self._pending = None
        # Fold the kept positions in even when no draft is wanted, so the head's context stays whole.
        h = self.model.mtp_forward(mx.array([tokens], dtype=mx.int32), hidden[None], self.cache)
        if max_tokens <= 0:
            mx.eval(*self.cache.state_arrays())
            return Draft(())
        committed = self.cache.checkpoint()
        draft = [int(mx.argmax(self.model.mtp_logits(h[:, -1])[0]).item())]
        while len(draft) < min(max_tokens, MAX_DEPTH):
            h = self.model.mtp_forward(mx.array([[draft[-1]]], dtype=mx.int32), h[:, -1:], self.cache)
            draft.append(int(mx.argmax(self.model.mtp_logits(h[:, -1])[0]).item()))
        self.cache.restore(committed)
        return Draft(tuple(draft))
