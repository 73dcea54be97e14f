"""The decoder's batch decisions row by row, on stand-in sequences: a batch probes its resting
device drafters together once per `probe_every` steps, host rows never force a verify with a
probe, a row's plan never outgrows the tokens it has left, and a row whose speculation just went
off rests instead of probing."""

from __future__ import annotations

from types import SimpleNamespace

from kapitsa.engine.speculative.controller import gpu_cost_curve
from kapitsa.engine.speculative.decoder import SpeculativeDecode
from kapitsa.engine.speculative.drafter import Draft
from kapitsa.engine.speculative.ngram import NGramDrafter

STEPS = 160


class DeviceDrafter:
    """A draft model's shape (drafts on the device), always wrong."""

    name = "draft"

    def propose(self, context, max_tokens: int) -> Draft:  # noqa: ANN001
        return Draft((0,) * max_tokens)

    def observe(self, tokens) -> None:  # noqa: ANN001
        pass


def _sequence(tokens: list[int], output: int, max_tokens: int = 10_000) -> SimpleNamespace:
    return SimpleNamespace(
        token_ids=list(tokens), output_ids=list(tokens[-output:]), max_tokens=max_tokens, is_finished=False,
        prediction_ids=(), prompt_tail=None, num_prompt_tokens=len(tokens) - output, draft_proposed=0,
        draft_accepted=0, prediction_proposed=0, prediction_accepted=0, step_drafts=(0, 0),
    )  # fmt: skip


def _resting(strategy: SpeculativeDecode, sequences, offsets) -> None:  # noqa: ANN001
    """Every row's speculation off (drafts that never pay), gone off at staggered positions."""
    for seq, off in zip(sequences, offsets, strict=True):
        controller = strategy._state(seq).controller
        controller.alphas = [0.05] * controller.max_draft
        controller._best.clear()
        controller._off_since = off


def _run_steps(strategy: SpeculativeDecode, sequences, *, pipelinable: bool) -> int:  # noqa: ANN001
    """Decode steps as the engine takes them; the steps that verify."""
    verifies = 0
    for _ in range(STEPS):
        pipelined = strategy.wants_pipeline(sequences) and pipelinable
        if not pipelined:
            states = [strategy._state(seq) for seq in sequences]
            for state in states:
                state.shadow.clear()
            drafts = strategy._drop_unpaid(states, [strategy._propose(state) for state in states])
            verifies += any(drafts)
            for state, draft in zip(states, drafts, strict=True):
                if draft:
                    state.controller.update(len(draft), 0)
        for seq in sequences:
            seq.token_ids.append(7)
            seq.output_ids.append(7)
    return verifies


def test_a_batch_probes_its_resting_device_drafters_together() -> None:
    rows = 16
    strategy = SpeculativeDecode(DeviceDrafter, name="draft", cost_curve=gpu_cost_curve(7))
    sequences = [_sequence(list(range(1000 * i, 1000 * i + 40)), output=20) for i in range(rows)]
    _resting(strategy, sequences, [20 - i for i in range(rows)])
    verifies = _run_steps(strategy, sequences, pipelinable=True)
    assert 1 <= verifies <= STEPS // 16 + 1  # one probe step per 16 steps, not one per row's probe


def test_host_rows_never_make_a_batch_verify_to_probe() -> None:
    """A batch that cannot pipeline (a row with logprobs or a grammar) calls `step` every step."""
    rows = 16
    strategy = SpeculativeDecode(NGramDrafter, cost_curve=gpu_cost_curve(7))
    sequences = [_sequence([1000 * i + t for t in range(10)] * 3, output=20) for i in range(rows)]
    _resting(strategy, sequences, [20 - i for i in range(rows)])
    assert _run_steps(strategy, sequences, pipelinable=False) <= STEPS // 16 + 1


def test_a_row_near_its_end_is_priced_at_the_draft_it_can_make() -> None:
    """A row with one token of room drafts one: the batch does not leave the pipeline for the
    seven it would otherwise be priced at, only to drop the one-token draft."""
    strategy = SpeculativeDecode(NGramDrafter)
    ending = _sequence([1, 2, 3, 4, 5, 6, 7, 8, 9] * 2 + [1, 2], output=3, max_tokens=5)
    others = [_sequence(list(range(100 + 40 * i, 120 + 40 * i)), output=3) for i in range(7)]
    controller = strategy._state(ending).controller
    controller.alphas = [0.95] * controller.max_draft
    controller._best.clear()
    assert strategy.wants_pipeline([ending, *others])
    assert strategy.stats.pipeline_exits == 0


def test_a_device_row_whose_speculation_just_went_off_rests() -> None:
    """Its estimate fell below paying at a verify (no `choose` has recorded it yet): the batch
    stays pipelined rather than leaving for a step whose draft is empty."""
    strategy = SpeculativeDecode(DeviceDrafter, name="draft", cost_curve=gpu_cost_curve(7))
    sequences = [_sequence(list(range(1000 * i, 1000 * i + 40)), output=20) for i in range(2)]
    _resting(strategy, sequences, [15, 15])
    strategy._state(sequences[0]).controller._off_since = None
    strategy._pipelined = True
    assert strategy.wants_pipeline(sequences)
    assert strategy._state(sequences[0]).controller.resting(len(sequences[0].output_ids))
