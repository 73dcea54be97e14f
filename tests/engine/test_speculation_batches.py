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
