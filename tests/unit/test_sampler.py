from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from kapitsa.engine.runner.sampler import SequenceSampler, filter_logits, sample_batch
from kapitsa.engine.types import SamplingParams


def _logits(seed: int = 0, vocab: int = 64) -> mx.array:
    return mx.random.normal((vocab,), key=mx.random.key(seed)) * 3


def test_greedy_is_argmax() -> None:
    logits = _logits()
    token = SequenceSampler(SamplingParams()).sample(logits)
    assert token.token_id == int(mx.argmax(logits).item())


def test_same_seed_same_tokens_and_independent_of_neighbours() -> None:
    params = SamplingParams(temperature=1.0, seed=42)
    rows = [_logits(i) for i in range(20)]
    alone = SequenceSampler(params)
    first = [alone.sample(r).token_id for r in rows]
    again = SequenceSampler(params)
    neighbour = SequenceSampler(SamplingParams(temperature=1.0, seed=7))
    batched = []
    for r in rows:
        picks = sample_batch([neighbour, again], mx.stack([r, r]))
        batched.append(picks[1].token_id)
    assert batched == first
    other = SequenceSampler(SamplingParams(temperature=1.0, seed=43))
    assert [other.sample(r).token_id for r in rows] != first


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    logits = _logits(3)
    best = int(mx.argmax(logits).item())
    for params in (
        SamplingParams(temperature=2.0, top_k=1, seed=1),
        SamplingParams(temperature=2.0, top_p=1e-6, seed=1),
    ):
        sampler = SequenceSampler(params)
        assert {sampler.sample(logits).token_id for _ in range(10)} == {best}


def test_filters_keep_the_expected_sets() -> None:
    logits = mx.log(mx.array([0.5, 0.3, 0.15, 0.05]))
    kept = lambda x: [i for i, v in enumerate(x.tolist()) if v != float("-inf")]  # noqa: E731
    assert kept(filter_logits(logits, top_k=2)) == [0, 1]
    assert kept(filter_logits(logits, top_p=0.8)) == [0, 1]
    assert kept(filter_logits(logits, top_p=0.81)) == [0, 1, 2]
    assert kept(filter_logits(logits, min_p=0.5)) == [0, 1]


def test_logit_bias_and_penalties() -> None:
    logits = mx.zeros((8,))
    sampler = SequenceSampler(SamplingParams(logit_bias=((5, 10.0),)))
    assert sampler.sample(logits).token_id == 5
    rows = mx.array([3.0, 2.9, 0.0, 0.0])
    penal = SequenceSampler(SamplingParams(frequency_penalty=0.5))
    assert penal.sample(rows).token_id == 0
    assert penal.sample(rows).token_id == 1  # 3.0 - 0.5 < 2.9
    rep = SequenceSampler(SamplingParams(repetition_penalty=2.0), prompt_ids=[0])
    assert rep.sample(rows).token_id == 1  # 3.0 / 2 < 2.9
    pres = SequenceSampler(SamplingParams(presence_penalty=1.0))
    assert [pres.sample(rows).token_id for _ in range(2)] == [0, 1]


def test_penalties_follow_the_reference_formulas() -> None:
    """Hugging Face's repetition penalty (the prompt counts as seen; ids outside the vocabulary are
    ignored) and OpenAI's presence / frequency penalties, against NumPy."""
    from kapitsa.engine.runner.penalties import Penalties

    rng = np.random.default_rng(0)
    row = rng.normal(size=12).astype(np.float32)
    prompt, output = [1, 3, 99], [3, 4, 4, 7]
    params = SamplingParams(repetition_penalty=1.7, presence_penalty=0.4, frequency_penalty=0.3)
    penalties = Penalties(params, prompt)
    for token in output[:2]:
        penalties.count(token)  # before the first apply: host ids
    penalties.apply(mx.array(row))
    for token in output[2:]:
        penalties.count(mx.array(token))  # lazy picks
    penalties.count(99)  # not a vocabulary id: ignored
    got = np.array(penalties.apply(mx.array(row)))

    expected = row.copy()
    seen = sorted({1, 3} | set(output))
    expected[seen] = np.where(expected[seen] > 0, expected[seen] / 1.7, expected[seen] * 1.7)
    for token in set(output):
        expected[token] -= 0.4 + 0.3 * output.count(token)
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_logprobs_are_normalised_and_sorted() -> None:
    logits = _logits(5)
    token = SequenceSampler(SamplingParams(logprobs=3)).sample(logits)
    expected = (logits - mx.logsumexp(logits)).tolist()
    assert token.logprob == pytest.approx(max(expected), abs=1e-5)
    assert [t for t, _ in token.top][0] == token.token_id
    lps = [lp for _, lp in token.top]
    assert lps == sorted(lps, reverse=True) and len(lps) == 3
    assert math.isclose(sum(math.exp(x) for x in expected), 1.0, rel_tol=1e-4)


def test_sampling_follows_the_distribution() -> None:
    logits = mx.log(mx.array([0.7, 0.2, 0.1]))
    sampler = SequenceSampler(SamplingParams(temperature=1.0, seed=0))
    picks = [sampler.sample(logits).token_id for _ in range(600)]
    assert abs(picks.count(0) / 600 - 0.7) < 0.07


def test_eos_decay_ends_a_greedy_answer_past_its_start() -> None:
    logits = mx.array([5.0, 1.0, -2.0])  # token 0 always wins; token 2 is the end of sequence
    params = SamplingParams(eos_decay=(3, 2.0))
    sampler = SequenceSampler(params, eos_ids=[2])
    picks = [sampler.sample(logits).token_id for _ in range(8)]
    # n generated <= 3: untouched; then -2 + 2 * (2**k - 1): k=1 -> 0, k=2 -> 4, k=3 -> 12 > 5
    assert picks[:6] == [0, 0, 0, 0, 0, 0] and picks[6] == 2


def test_lazy_picks_queued_ahead_decay_like_picks_taken_in_turn() -> None:
    """Pipelined decoding queues a pick before the previous token is read back; the decay still
    counts every token before the pick."""
    logits = mx.array([5.0, 1.0, -2.0])
    params = SamplingParams(eos_decay=(3, 2.0))
    in_turn = SequenceSampler(params, eos_ids=[2])
    expected = [in_turn.sample(logits).token_id for _ in range(8)]
    lazy = SequenceSampler(params, eos_ids=[2])
    assert lazy.is_stateless
    queued, got = lazy.lazy_pick(logits), []
    for _ in range(8):
        following = lazy.lazy_pick(logits)
        got.append(int(queued.item()))
        lazy.observe(got[-1])
        queued = following
    assert got == expected


def test_eos_decay_needs_end_ids_and_respects_ignore_eos() -> None:
    logits = mx.array([5.0, 1.0, -2.0])
    for sampler in (
        SequenceSampler(SamplingParams(eos_decay=(0, 10.0))),
        SequenceSampler(SamplingParams(eos_decay=(0, 10.0), ignore_eos=True), eos_ids=[2]),
    ):
        assert [sampler.sample(logits).token_id for _ in range(6)] == [0] * 6
        assert sampler.is_greedy_plain


def test_eos_decay_is_validated() -> None:
    with pytest.raises(ValueError):
        SamplingParams(eos_decay=(4, 0.5))


def test_eos_decay_never_overflows_and_keeps_a_banned_eos_banned() -> None:
    params = SamplingParams(eos_decay=(0, 1.05), logit_bias=((2, -100.0),))
    sampler = SequenceSampler(params, eos_ids=[2])
    sampler._generated = 20_000  # far past where 1.05 ** n overflows a float
    row = sampler.process(mx.array([5.0, 1.0, float("-inf")]))
    assert mx.isfinite(row[:2]).all().item() and row[2].item() == float("-inf")


CLOSE = 3  # the token that ends reasoning in the budget tests


def _budget_rows(close_at: int | None, steps: int = 10) -> list[mx.array]:
    """Logits rows whose argmax is token 0, except at `close_at`, where it is CLOSE."""
    rows = []
    for i in range(steps):
        row = [5.0, 1.0, -2.0, -4.0]
        if i == close_at:
            row[CLOSE] = 9.0
        rows.append(mx.array(row))
    return rows


@pytest.mark.parametrize(
    ("close_at", "expected_closes"), [(None, [4]), (2, [2]), (7, [4, 7])], ids=["never", "early", "late"]
)
def test_a_reasoning_budget_forces_the_close_once_it_is_spent(close_at, expected_closes) -> None:
    """Four tokens of budget: the fifth pick is the close unless the model closed reasoning earlier;
    after the close nothing is forced. Taken in turn and queued ahead (pipelined) alike."""
    params = SamplingParams(reasoning_budget=(4, CLOSE))
    rows = _budget_rows(close_at)
    in_turn = SequenceSampler(params)
    taken = [in_turn.sample(r).token_id for r in rows]
    lazy = SequenceSampler(params)
    assert lazy.is_stateless and not lazy.is_greedy_plain
    queued, piped = lazy.lazy_pick(rows[0]), []
    for row in rows[1:]:
        following = lazy.lazy_pick(row)
        piped.append(int(queued.item()))
        lazy.observe(piped[-1])
        queued = following
    piped.append(int(queued.item()))
    assert taken == piped
    assert [i for i, t in enumerate(taken) if t == CLOSE] == expected_closes
    assert in_turn.is_greedy_plain  # once reasoning is closed the row takes the shared argmax again


def test_a_reasoning_budget_needs_non_negative_values() -> None:
    with pytest.raises(ValueError, match="reasoning_budget"):
        SamplingParams(reasoning_budget=(-1, CLOSE))
