"""A verify runs every row of a batch, so a batch verifies only when its rows' drafts together pay
for that (batch_gate.py): one row's good drafts do not drag its neighbours into verifies that
cost more than they give, and rows that all draft well still verify together."""

from __future__ import annotations

import asyncio

import pytest
from engine_standins import ByteTokenizer, tiny_model  # noqa: I001
from test_speculation_at_rest import HostOracle, _client

from kapitsa.engine.speculative.batch_gate import batch_verify_pays
from kapitsa.engine.speculative.controller import DraftLengthController, gpu_cost_curve
from kapitsa.engine.speculative.decoder import SpeculativeDecode
from kapitsa.engine.types import GenerationRequest, SamplingParams, TokenEvent

PROMPTS = ["The quick brown fox", "def add(x, y):", "Once upon a time", "SELECT * FROM t"]
N = 48
MAX_DRAFT = 6


def compute_bound_curve(max_draft: int) -> list[float]:
    """c(T) where a verify costs about its tokens (the CPU's shape: 0.75 of a step per token)."""
    return [1.0 + 0.75 * (t - 1) for t in range(1, max_draft + 2)]


@pytest.mark.parametrize("alpha", [0.2, 0.5, 0.8, 0.95])
@pytest.mark.parametrize("curve", [gpu_cost_curve(MAX_DRAFT), compute_bound_curve(MAX_DRAFT)])
def test_at_batch_one_the_gate_is_the_controllers_rule(alpha, curve) -> None:
    controller = DraftLengthController(max_draft=MAX_DRAFT, cost=list(curve), prior=alpha)
    for k in range(1, MAX_DRAFT + 1):
        pays = batch_verify_pays([controller.expected_tokens(k)], curve, 1 + k, margin=controller.margin)
        rate = controller.expected_tokens(k) / curve[k]
        assert pays == (rate > 1 + controller.margin)


def test_one_good_row_does_not_pay_for_a_batch_but_good_rows_together_do() -> None:
    gpu, cpu = gpu_cost_curve(7), compute_bound_curve(7)
    one_good = [5.0] + [1.0] * 7
    assert not batch_verify_pays(one_good, gpu, 8)
    assert not batch_verify_pays(one_good, cpu, 8)
    all_good = [3.0] * 8
    assert batch_verify_pays(all_good, gpu, 8)  # the rows share one read of the weights
    assert not batch_verify_pays(all_good, cpu, 8)  # 8 tokens a row cost 6.25 steps there
    assert not batch_verify_pays(all_good, gpu, 8, extra_cost=2.0)  # leaving the pipeline counts


@pytest.fixture(scope="module")
def model():  # noqa: ANN201
    return tiny_model("qwen3_5")


async def _burst(client) -> list[list[int]]:  # noqa: ANN001
    async def one(prompt: str) -> list[int]:
        params = SamplingParams(max_tokens=N, ignore_eos=True)
        request = GenerationRequest(prompt=prompt, sampling=params)
        return [t async for e in client.generate(request) if isinstance(e, TokenEvent) for t in e.token_ids]

    return list(await asyncio.gather(*(one(p) for p in PROMPTS)))


async def _outputs(model, decode=None) -> list[list[int]]:  # noqa: ANN001
    client = _client(model, decode)
    try:
        return await _burst(client)
    finally:
        client.close()


@pytest.fixture(scope="module")
def plain(model) -> list[list[int]]:  # noqa: ANN001
    return asyncio.run(_outputs(model))


class RightFor(HostOracle):
    """The oracle, right only for the prompts in `right`; always wrong for the others."""

    def __init__(self, references, right: set[tuple[int, ...]]) -> None:  # noqa: ANN001
        super().__init__(references, right_from=0)
        self.right = right

    def propose(self, context, max_tokens: int):  # noqa: ANN001, ANN201
        draft = super().propose(context, max_tokens)
        if any(tuple(context[: len(p)]) == p for p in self.right):
            return draft
        return type(draft)(tuple((t + 1) % 250 + 3 for t in draft.tokens))


def _strategy(plain, right: list[int], curve: list[float]) -> SpeculativeDecode:  # noqa: ANN001
    tok = ByteTokenizer()
    prompts = [tuple(tok.encode(p)) for p in PROMPTS]
    references = dict(zip(prompts, plain, strict=True))
    chosen = {prompts[i] for i in right}
    return SpeculativeDecode(
        lambda: RightFor(references, chosen), name="host", max_draft=MAX_DRAFT, cost_curve=curve
    )


async def test_one_rows_good_drafts_do_not_make_the_batch_verify(model, plain) -> None:  # noqa: ANN001
    strategy = _strategy(plain, right=[3], curve=compute_bound_curve(MAX_DRAFT))
    assert await _outputs(model, strategy) == plain
    # every verify ran one row: the good row's drafts verified only while it decoded alone
    assert strategy.stats.rows == strategy.stats.steps


async def test_rows_that_all_draft_well_verify_together(model, plain) -> None:  # noqa: ANN001
    strategy = _strategy(plain, right=[0, 1, 2, 3], curve=gpu_cost_curve(MAX_DRAFT))
    assert await _outputs(model, strategy) == plain
    assert strategy.stats.rows > strategy.stats.steps  # verifies of several rows at once
    assert strategy.stats.tokens_per_step > 2


class Staggered:
    """Streams of `tokens` tokens each, the second submitted once the first has 24 (it decodes
    alone first) unless `stagger` is off."""

    def __init__(self, prompts: list[str], tokens: int = N, stagger: bool = True) -> None:
        self.prompts, self.tokens, self.stagger = prompts, tokens, stagger

    async def burst(self, client) -> list[list[int]]:  # noqa: ANN001
        first_along = asyncio.Event()

        async def one(i: int, prompt: str) -> list[int]:
            if i == 1 and self.stagger:
                await first_along.wait()
            params = SamplingParams(max_tokens=self.tokens, ignore_eos=True)
            request = GenerationRequest(prompt=prompt, sampling=params)
            ids: list[int] = []
            async for event in client.generate(request):
                if isinstance(event, TokenEvent):
                    ids += event.token_ids
                    if len(ids) >= 24:
                        first_along.set()
            return ids

        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(self.prompts))))

    async def outputs(self, model, decode=None) -> list[list[int]]:  # noqa: ANN001
        client = _client(model, decode)
        try:
            return await self.burst(client)
        finally:
            client.close()


class FirstOnly(HostOracle):
    """Right for the first prompt (drafts cut to `keep` tokens); no draft for the other."""

    def __init__(self, references, keep: int) -> None:  # noqa: ANN001
        super().__init__(references, right_from=0)
        self.keep = keep

    def propose(self, context, max_tokens: int):  # noqa: ANN001, ANN201
        draft = super().propose(context, max_tokens)
        return type(draft)(draft.tokens[: self.keep])


def _first_only(plain: list[list[int]], keep: int) -> SpeculativeDecode:
    references = {tuple(ByteTokenizer().encode(PROMPTS[0])): plain[0]}
    return SpeculativeDecode(
        lambda: FirstOnly(references, keep),
        name="host",
        max_draft=MAX_DRAFT,
        cost_curve=gpu_cost_curve(MAX_DRAFT),
    )


async def test_a_row_whose_drafts_pay_for_the_batch_keeps_verifying_with_it(model) -> None:  # noqa: ANN001
    """One row's full, always-right drafts are worth (7 + 1) / 2 tokens a row against a verify's
    ~1.9 steps: the batch verifies, since the row's estimate learns while the batch waits."""
    together = Staggered(PROMPTS[:2], stagger=False)
    plain_together = await together.outputs(model)
    strategy = _first_only(plain_together, keep=MAX_DRAFT)
    assert await together.outputs(model, strategy) == plain_together
    assert strategy.stats.rows > strategy.stats.steps  # verifies of both rows at once


async def test_a_batch_never_leaves_the_pipeline_for_a_draft_it_then_drops(model) -> None:  # noqa: ANN001
    """One-token drafts do not pay for a batch of two: the decoder stays pipelined, rather than
    pricing a full-length draft, leaving the pipeline and then stepping plainly without it."""
    staggered = Staggered(PROMPTS[:2], tokens=96)
    plain_staggered = await staggered.outputs(model)
    strategy = _first_only(plain_staggered, keep=1)
    dropped = []
    drop = strategy._drop_unpaid

    def counting(states, drafts):  # noqa: ANN001, ANN202
        kept = drop(states, drafts)
        dropped.append(any(drafts) and not any(kept))
        return kept

    strategy._drop_unpaid = counting
    assert await staggered.outputs(model, strategy) == plain_staggered
    assert not any(dropped)


class DeviceOracle(HostOracle):
    """A drafter that drafts on the device (a draft model, an MTP head): it rests between probes."""

    drafts_on_host = False


async def test_a_resting_device_drafter_still_probes_in_a_batch(model) -> None:  # noqa: ANN001
    """Wrong for the first 30 tokens, right after: its probes (one verify per 16 tokens) go on in
    a batch, so speculation turns back on once drafts match."""
    together = Staggered(PROMPTS[:2], tokens=120, stagger=False)
    plain_long = await together.outputs(model)
    references = dict(zip((tuple(ByteTokenizer().encode(p)) for p in PROMPTS[:2]), plain_long, strict=True))
    strategy = SpeculativeDecode(
        lambda: DeviceOracle(references, right_from=30),
        name="draft",
        max_draft=MAX_DRAFT,
        cost_curve=gpu_cost_curve(MAX_DRAFT),
    )
    assert await together.outputs(model, strategy) == plain_long
    assert strategy.stats.accepted >= 60  # speculation came back on


def test_a_dropped_draft_from_the_prediction_is_not_counted_as_rejected() -> None:
    """Predicted Outputs usage counts only drafts a verify scored."""
    from types import SimpleNamespace

    from kapitsa.engine.runner.sampler import SampledToken
    from kapitsa.engine.speculative.ngram import NGramDrafter

    def sequence(tokens: list[int], prediction: tuple[int, ...] = ()) -> SimpleNamespace:
        return SimpleNamespace(
            token_ids=list(tokens), output_ids=[tokens[-1]], max_tokens=100, is_finished=False,
            prediction_ids=prediction, prompt_tail=None, num_prompt_tokens=len(tokens) - 1,
            draft_proposed=0, draft_accepted=0, prediction_proposed=0, prediction_accepted=0, step_drafts=(0, 0),
        )  # fmt: skip

    strategy = SpeculativeDecode(NGramDrafter, max_draft=MAX_DRAFT, cost_curve=gpu_cost_curve(MAX_DRAFT))
    predicted = sequence([10, 11, 12, 13], prediction=(12, 13, 40, 41, 42, 43, 44, 45))
    states = [strategy._state(predicted), strategy._state(sequence([20, 21, 22, 23]))]
    for state in states:
        state.controller.alphas = [0.65] * MAX_DRAFT  # a draft of this row alone does not pay for two
        state.controller._best.clear()
    drafts = [strategy._propose(state) for state in states]
    assert drafts[0] and states[0].from_prediction
    assert strategy._drop_unpaid(states, drafts) == [[], []]
    strategy._count([[SampledToken(40, 0.0)], [SampledToken(24, 0.0)]], [0, 0], states)
    assert predicted.prediction_proposed == predicted.prediction_accepted == 0


async def test_the_engine_reports_its_verifies_and_drafts(model) -> None:  # noqa: ANN001
    """`EngineStats` (and /metrics) carry the decoder's verifies, drafted and accepted tokens and
    pipeline exits: how an operator tells whether speculation pays on their traffic."""
    from kapitsa.server.metrics import prometheus_text

    together = Staggered(PROMPTS[:2], stagger=False)
    plain_together = await together.outputs(model)
    strategy = _first_only(plain_together, keep=MAX_DRAFT)
    client = _client(model, strategy)
    try:
        await together.burst(client)
        stats = client.stats()
    finally:
        client.close()
    counts = strategy.stats
    assert counts.steps > 0 and counts.accepted > 0
    assert (stats.speculative_verifies, stats.draft_tokens_proposed, stats.draft_tokens_accepted) == (
        counts.steps,
        counts.proposed,
        counts.accepted,
    )
    assert stats.speculative_pipeline_exits == counts.pipeline_exits
    text = prometheus_text(stats)
    assert (
        f"# TYPE kapitsa_speculative_verifies_total counter\nkapitsa_speculative_verifies_total {counts.steps}\n"
        in text
    )
    assert f"kapitsa_draft_tokens_accepted_total {counts.accepted}\n" in text
