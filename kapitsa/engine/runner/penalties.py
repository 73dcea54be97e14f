"""Repetition, presence and frequency penalties over counts kept on the device.

The counts of the tokens generated so far live in a float32 `[V]` array that each pick updates
lazily, so a pick that is still queued (pipelined decoding) is already counted by the next one:
penalties need no host read-back between steps. The formulas are Hugging Face's
(`RepetitionPenaltyLogitsProcessor`: a seen token's positive logit divided, a negative one
multiplied; the prompt counts as seen) and OpenAI's (presence once, frequency per occurrence, over
the output only).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from kapitsa.engine.types import SamplingParams


class Penalties:
    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int]) -> None:
        self.repetition = params.repetition_penalty
        self.presence = params.presence_penalty
        self.frequency = params.frequency_penalty
        self._prompt_ids = sorted(set(prompt_ids)) if self.repetition != 1.0 else []
        self._prompt_seen: mx.array | None = None  # [V] bool, made at the first pick (V unknown before)
        self._counts: mx.array | None = None  # [V] float32 output-token counts
        self._early: list[int] = []  # tokens observed before the first pick made the arrays

    @property
    def active(self) -> bool:
        return self.repetition != 1.0 or bool(self.presence) or bool(self.frequency)

    def count(self, token: int | mx.array) -> None:
        """One more output token (a host id, or a lazy 0-d pick)."""
        if self._counts is None:
            assert isinstance(token, int), "a lazy pick comes after the first apply()"
            self._early.append(token)
            return
        if isinstance(token, int) and not 0 <= token < self._counts.shape[0]:
            return  # not a vocabulary id (a lazy pick always is: it comes from the logits)
        self._counts = self._counts.at[token].add(1.0)

    def apply(self, logits: mx.array) -> mx.array:
        """A float32 `[V]` row with the penalties applied."""
        counts = self._output_counts(logits.shape[-1])
        if self.repetition != 1.0:
            assert self._prompt_seen is not None
            seen = self._prompt_seen | (counts > 0)
            penalised = mx.where(logits > 0, logits / self.repetition, logits * self.repetition)
            logits = mx.where(seen, penalised, logits)
        if self.presence or self.frequency:
            logits = logits - mx.where(counts > 0, self.presence + self.frequency * counts, 0.0)
        return logits

    def _output_counts(self, vocab: int) -> mx.array:
        if self._counts is None:
            self._counts = _histogram(self._early, vocab)
            self._prompt_seen = _histogram(self._prompt_ids, vocab) > 0
            self._early = []
        return self._counts


def _histogram(ids: Sequence[int], vocab: int) -> mx.array:
    """`[V]` float32 counts of `ids` (ids outside the vocabulary ignored)."""
    inside = [i for i in ids if 0 <= i < vocab]
    counts = mx.zeros((vocab,), dtype=mx.float32)
    return counts.at[mx.array(inside, dtype=mx.int32)].add(1.0) if inside else counts
