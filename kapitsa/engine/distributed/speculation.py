"""Speculative decoding in a group: rank 0 drafts by n-gram lookup, the whole group verifies.

Each decode step of a group costs at least one network round trip (the command's broadcast, and
in a pipeline the hidden states' hops around the ring), and a verify of `[last, d1..dk]` costs
about as much as one token while k + 1 fits the command's inline ids (control.INLINE): one
collective either way, and the rows share one read of the weights. So the draft length is priced
with `default_cost_curve` (c(T) = 1 + 0.08 (T - 1) decode steps), not a measured one: the group's
StepClock times prefill chunks per token, which says nothing about a verify of a few tokens, and
the CPU's measured compute curve (speculative/cost.py) leaves the round trip out.

The pieces are the single engine's (speculative/): `NGramDrafter` proposes, a
`DraftLengthController` picks each draft's length from the running acceptance, `ShadowGuess`
scores the drafter's guesses against the tokens that arrive while drafts do not pay (so turning
speculation back on costs no verify), and `accept_chain` keeps exactly what the target itself
would emit, greedy or sampled. The rejected tail of a verify is rolled back on every rank by the
next command (control.py). Drafts are verified only while one sequence decodes: a step of several
rows is plain, and each sequence keeps its own drafter and estimates for when it runs alone again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from kapitsa.engine.runner.sampler import SampledToken
from kapitsa.engine.runner.sequence import Sequence
from kapitsa.engine.speculative.acceptance import accept_chain, is_plain_greedy
from kapitsa.engine.speculative.controller import (
    DEFAULT_MAX_DRAFT,
    DraftLengthController,
    default_cost_curve,
)
from kapitsa.engine.speculative.decoder import HOST_DRAFTER_DECAY, HOST_DRAFTER_PRIOR, SpeculativeStats
from kapitsa.engine.speculative.ngram import NGramDrafter
from kapitsa.engine.speculative.shadow import ShadowGuess

GROUP_SPECULATIVE_MODES = ("auto", "ngram", "none")  # what `--speculative` may say for a group


def group_speculates(mode: str | None) -> bool:
    """Whether a group drafts for `--speculative mode` (None: the default, "auto": n-gram)."""
    return mode in (None, "auto", "ngram")


@dataclass
class _Drafting:
    """One sequence's drafter, draft-length controller and shadow guess."""

    drafter: NGramDrafter
    controller: DraftLengthController
    shadow: ShadowGuess = field(default_factory=ShadowGuess)
    from_reference: bool = False  # the draft being verified was copied from the predicted output


class GroupSpeculation:
    """Rank 0's drafting and acceptance, per sequence the group decodes.

    Args:
        max_draft: the longest draft (`--draft-tokens`); a verify of more than `INLINE` tokens
            sends its ids in a second collective.
    """

    name = "ngram"

    def __init__(self, max_draft: int | None = None) -> None:
        self.max_draft = max_draft or DEFAULT_MAX_DRAFT
        self.stats = SpeculativeStats()  # its `steps` counts plain steps too (a group has no pipeline)
        self.verifies = 0  # forwards that verified a draft
        self._states: dict[int, _Drafting] = {}  # by id() of the sequence

    @property
    def acceptance_rate(self) -> float:
        return self.stats.acceptance_rate

    @property
    def tokens_per_step(self) -> float:
        return self.stats.tokens_per_step

    def start(self, seq: Sequence) -> None:
        """A new sequence: its drafts and acceptance estimates start from the prior."""
        controller = DraftLengthController(
            max_draft=self.max_draft,
            cost=default_cost_curve(self.max_draft),
            prior=HOST_DRAFTER_PRIOR,
            decay=HOST_DRAFTER_DECAY,
        )
        drafter = NGramDrafter()
        if seq.prediction_ids:  # a predicted output: drafted from beside the context
            drafter.add_reference(seq.prediction_ids)
        self._states[id(seq)] = _Drafting(drafter, controller)

    def finish(self, seq: Sequence) -> None:
        self._states.pop(id(seq), None)

    def propose(self, seq: Sequence) -> list[int]:
        """The draft to verify after `seq`'s last token; [] for a plain step.

        While the controller says drafts do not pay, the drafter's guess is scored against the
        tokens that arrive instead, as the single engine does while its speculation rests."""
        state = self._states[id(seq)]
        context, shadow = seq.token_ids, state.shadow
        shadow.score(context, state.controller)
        room = min(self.max_draft, seq.max_tokens - len(seq.output_ids) - 1)
        if room <= 0:
            return []
        k = state.controller.best_length(shadow.current_run)
        draft = list(state.drafter.propose(context, min(k, room)).tokens) if k > 0 else []
        state.from_reference = bool(draft) and state.drafter.drafted_from_reference == tuple(draft)
        if draft:
            shadow.clear()  # the verify scores this draft
        elif not shadow.live:
            shadow.guess(state.drafter.propose(context, self.max_draft).tokens, len(context))
        return draft

    def accept(self, seq: Sequence, draft: list[int], rows: mx.array) -> tuple[list[SampledToken], int]:
        """The tokens to emit from a verify's `[1 + len(draft), V]` logits, and how many of the
        verify's tokens every rank drops (the rejected drafts)."""
        state = self._states[id(seq)]
        argmax = mx.argmax(rows, axis=-1).tolist() if is_plain_greedy(seq.sampler) else None
        tokens, accepted = accept_chain(seq.sampler, draft, rows, argmax)
        state.controller.update(len(draft), accepted, state.shadow.run)
        state.shadow.verified(len(draft), accepted)
        self.count(len(tokens), len(draft), accepted)
        seq.draft_proposed += len(draft)  # the sequence's usage counts its own drafts
        seq.draft_accepted += accepted
        predicted = accepted if state.from_reference else 0  # copied from the predicted output
        seq.prediction_proposed += len(draft) if state.from_reference else 0
        seq.prediction_accepted += predicted
        seq.step_drafts = (accepted, predicted)  # emit_tokens takes back what a stop cuts off
        return tokens, len(draft) - accepted

    def count(self, emitted: int, proposed: int = 0, accepted: int = 0, *, rows: int = 1) -> None:
        """One decode step of `rows` rows (a plain one: a token a row, nothing proposed)."""
        s = self.stats
        s.steps += 1
        self.verifies += proposed > 0
        s.rows += rows
        s.emitted += emitted
        s.proposed += proposed
        s.accepted += accepted
