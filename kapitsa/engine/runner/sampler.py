"""Token selection: logits processors, seeded sampling and top-k logprobs, one sequence at a time.

Each sequence owns a `SequenceSampler` with its own PRNG key stream, so a seeded request draws the
same tokens whether it runs alone or next to other requests. Greedy rows of a batch take a shared
argmax fast path (`sample_batch`).
"""

from __future__ import annotations

import math
import secrets
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx

from kapitsa.engine.runner.penalties import Penalties
from kapitsa.engine.types import SamplingParams

if TYPE_CHECKING:
    from kapitsa.engine.text.constraint import TokenConstraint

_NEG_INF = float("-inf")
_SEED_RANGE = 2**64
_MAX_LOG_GROWTH = 80.0  # exp(80) already dwarfs any logit; past it the float would overflow


@dataclass(slots=True, frozen=True)
class SampledToken:
    token_id: int
    logprob: float  # log-probability under the model's raw distribution
    top: tuple[tuple[int, float], ...] = ()  # best alternatives (id, logprob), when asked for


class SequenceSampler:
    """Picks the next token of one sequence from its logits row.

    Args:
        params: the request's sampling parameters.
        prompt_ids: the prompt, which the repetition penalty also covers (as in Hugging Face).
        eos_ids: the tokens `params.eos_decay` favours.
        constraint: the grammar state of a constrained sequence (its mask applies after penalties).
    """

    def __init__(
        self,
        params: SamplingParams,
        prompt_ids: Sequence[int] = (),
        eos_ids: Sequence[int] = (),
        *,
        constraint: TokenConstraint | None = None,
    ) -> None:
        self.params = params
        self.constraint = constraint
        decays = params.eos_decay is not None and bool(eos_ids) and not params.ignore_eos
        self._eos_ids = mx.array(sorted(eos_ids), dtype=mx.int32) if decays else None
        self._generated = 0
        self._unobserved = 0  # picks queued lazily (pipelined decoding) whose token is not yet observed
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self._key = mx.random.key(seed % _SEED_RANGE)  # OpenAI takes any integer; MLX a uint64
        self._penalties = Penalties(params, prompt_ids)
        # a reasoning budget: open until its closing token is observed; the picks queued but not yet
        # observed (at most the pipeline's depth) are read on the device, where one may have closed it
        self._reasoning_open = params.reasoning_budget is not None
        self._queued_picks: deque[mx.array] = deque()
        bias = params.logit_bias
        self._bias_ids = mx.array([i for i, _ in bias], dtype=mx.int32) if bias else None
        self._bias_values = mx.array([b for _, b in bias], dtype=mx.float32) if bias else None

    @property
    def is_greedy_plain(self) -> bool:
        """True when the pick is a bare argmax of the raw logits (no processor changes it)."""
        p = self.params
        return p.temperature == 0 and not self._changes_logits()

    @property
    def is_stateless(self) -> bool:
        """True when a pick needs nothing the host must read back first (no logprobs, no grammar),
        so it can stay lazy on the device (pipelined decoding): the EOS decay reads only how many
        tokens came before the pick, and the penalties' counts are device arrays that `lazy_pick`
        updates lazily."""
        return self.params.logprobs is None and self.constraint is None

    def _changes_logits(self) -> bool:
        changes = self.params.logit_bias or self._penalties.active or self._eos_ids is not None
        return bool(changes or self.constraint is not None or self._reasoning_open)

    def observe(self, token_id: int) -> None:
        """Record a generated token (penalties count output tokens)."""
        if self._unobserved:  # a lazy pick's token: counted when it was queued
            self._unobserved -= 1
            if self._queued_picks:
                self._queued_picks.popleft()
        elif self._penalties.active:
            self._penalties.count(token_id)
        self._generated += 1
        if self._reasoning_open and token_id == self.params.reasoning_budget[1]:  # type: ignore[index]
            self._reasoning_open = False
            self._queued_picks.clear()
        if self.constraint is not None:
            self.constraint.advance(token_id)

    def prepare(self) -> None:
        """Host work for the next pick that needs no logits (a grammar's mask): call it while the
        forward runs."""
        if self.constraint is not None:
            self.constraint.prepare()

    def process(self, logits: mx.array) -> mx.array:
        """Apply bias and penalties to a [V] float32 logits row."""
        if self._bias_ids is not None:
            logits = logits.at[self._bias_ids].add(self._bias_values)
        if self._penalties.active:
            logits = self._penalties.apply(logits)
        logits = self._decay_towards_eos(logits)
        logits = self._hold_to_budget(logits)
        return logits if self.constraint is None else self.constraint.apply(logits)

    def _hold_to_budget(self, logits: mx.array) -> mx.array:
        """Past the reasoning budget, reasoning that is still open gets only its closing token."""
        if not self._reasoning_open:
            return logits
        budget, close = self.params.reasoning_budget  # type: ignore[misc]
        if self._generated + self._unobserved < budget:
            return logits
        only_close = mx.where(mx.arange(logits.shape[-1]) == close, logits, _NEG_INF)
        if not self._queued_picks:
            return only_close
        closed = mx.any(mx.stack(list(self._queued_picks)) == close)
        return mx.where(closed, logits, only_close)

    def _decay_towards_eos(self, logits: mx.array) -> mx.array:
        if self._eos_ids is None or self.params.eos_decay is None:
            return logits
        start, factor = self.params.eos_decay
        generated = self._generated + self._unobserved  # tokens before this pick, queued ones too
        if generated <= start:
            return logits
        growth = math.exp(min((generated - start) * math.log(factor), _MAX_LOG_GROWTH)) - 1.0
        eos = logits[self._eos_ids]
        boost = mx.where(mx.isinf(eos), 0.0, mx.abs(eos) * growth)  # a banned EOS stays banned
        return logits.at[self._eos_ids].add(boost)

    def _next_key(self) -> mx.array:
        self._key, key = mx.random.split(self._key)
        return key

    def choose(self, logits: mx.array) -> mx.array:
        """The chosen token id (a 0-d array) from a processed [V] row."""
        p = self.params
        if p.temperature == 0:
            return mx.argmax(logits)
        key = self._next_key()  # drawn even when filters leave one choice, so the stream stays aligned
        logits = filter_logits(logits / p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p)
        return mx.random.categorical(logits, key=key)

    @property
    def observed(self) -> int:
        """Tokens picked and read back (each counted by the penalties, stepped by a grammar)."""
        return self._generated

    def forget_queued(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """Drop the picks queued lazily that were never read back (their step failed and its rows
        go back to the queue): the penalties count the tokens observed, `output_ids`, again."""
        if not self._unobserved:
            return
        self._unobserved = 0
        self._queued_picks.clear()
        if self._penalties.active:
            self._penalties = Penalties(self.params, prompt_ids)
            for token_id in output_ids:
                self._penalties.count(token_id)

    def lazy_pick(self, logits: mx.array) -> mx.array:
        """The pick from a float32 [V] logits row (processed here), left lazy (pipelined decoding):
        its token is observed when read back, and the picks queued after it count it already.
        (An all-greedy batch's shared argmax skips this: plain greedy rows have nothing to count.)"""
        token = self.choose(self.process(logits))
        if self._penalties.active:
            self._penalties.count(token)
        if self._reasoning_open:
            self._queued_picks.append(token)
        self._unobserved += 1
        return token

    def sample(self, logits: mx.array) -> SampledToken:
        """Pick from a [V] logits row of any float dtype."""
        row = logits.astype(mx.float32)
        token = self.choose(self.process(row))
        return self._finish(row, token)

    def _finish(self, row: mx.array, token: mx.array) -> SampledToken:
        wants_logprobs = self.params.logprobs is not None
        if not wants_logprobs:
            token_id = int(token.item())
            self.observe(token_id)
            return SampledToken(token_id, 0.0)
        logprobs = row - mx.logsumexp(row)
        top_n = self.params.logprobs or 0
        top_ids = mx.argsort(-logprobs)[:top_n] if top_n else None
        mx.eval(token, logprobs, *(x for x in (top_ids,) if x is not None))
        token_id = int(token.item())
        self.observe(token_id)
        top: tuple[tuple[int, float], ...] = ()
        if top_ids is not None:
            top_list = top_ids.tolist()
            top = tuple(zip(top_list, logprobs[top_ids].tolist(), strict=True))
        return SampledToken(token_id, float(logprobs[token_id].item()), top)


def filter_logits(logits: mx.array, *, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> mx.array:
    """Mask a temperature-scaled [V] row to -inf outside top-k, the top-p nucleus and min-p."""
    if 0 < top_k < logits.shape[-1]:
        kth = mx.sort(logits)[-top_k]
        logits = mx.where(logits < kth, _NEG_INF, logits)
    if top_p < 1.0:
        order = mx.argsort(-logits)
        probs = mx.softmax(logits[order])
        # keep a token while the mass before it is below top_p (the first token always stays)
        mass_before = mx.cumsum(probs) - probs
        drop = (mass_before >= top_p)[mx.argsort(order)]  # back to vocabulary order
        logits = mx.where(drop, _NEG_INF, logits)
    if min_p > 0.0:
        probs = mx.softmax(logits)
        logits = mx.where(probs < min_p * probs.max(), _NEG_INF, logits)
    return logits


def sample_batch(samplers: Sequence[SequenceSampler], logits: mx.array) -> list[SampledToken]:
    """Pick one token per row of [B, V] logits; plain greedy rows share one argmax."""
    if all(s.is_greedy_plain and s.params.logprobs is None for s in samplers):
        ids = mx.argmax(logits, axis=-1).tolist()
        for sampler, token_id in zip(samplers, ids, strict=True):
            sampler.observe(token_id)
        return [SampledToken(t, 0.0) for t in ids]
    return [sampler.sample(logits[i]) for i, sampler in enumerate(samplers)]
