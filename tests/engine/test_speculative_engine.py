"""Speculative decoding inside the engine: greedy output is the model's own, token for token."""

from __future__ import annotations

import asyncio
import random

import pytest
from engine_standins import EOS, ByteTokenizer, tiny_model  # noqa: I001

from kapitsa.engine.cache.hybrid import HybridCache
from kapitsa.engine.inprocess import InProcessEngine
from kapitsa.engine.options import EngineConfig
from kapitsa.engine.speculative.decoder import GPU_VERIFY_WIDTHS, SpeculativeDecode
from kapitsa.engine.speculative.drafter import Draft
from kapitsa.engine.speculative.factory import make_decode_strategy
from kapitsa.engine.types import FinishEvent, GenerationRequest, ModelInfo, SamplingParams, TokenEvent
from kapitsa.errors import InvalidRequest

PROMPTS = [
    "def add(x, y):\n    return x + y\n\ndef add(x, y):\n",
    "abc abc abc abc",
    "The quick brown fox. The quick brown fox. The quick",
]
N_TOKENS = 24

# A GPU pads drafts to verify widths (GPU_VERIFY_WIDTHS); the CPU doesn't. The drafters that read
# the target's hidden states or keep their own caches run both ways here.
PADDING = pytest.mark.parametrize("widths", [None, GPU_VERIFY_WIDTHS], ids=["backend", "padded"])


class OracleDrafter:
    """Copies the known greedy continuation, corrupting one position at random: every accept
    length from 0 to k happens, so rollback is exercised at every depth."""

    name = "oracle"

    def __init__(self, references: dict[tuple[int, ...], list[int]], seed: int) -> None:
        self.references = references
        self.rng = random.Random(seed)

    def observe(self, new_tokens) -> None:
        pass

    def propose(self, context, max_tokens: int) -> Draft:
        for prompt, ref in self.references.items():
            if tuple(context[: len(prompt)]) == prompt:
                tail = list(ref[len(context) - len(prompt) : len(context) - len(prompt) + max_tokens])
                if tail and self.rng.random() < 0.7:
                    tail[self.rng.randrange(len(tail))] = self.rng.randrange(3, 200)
                return Draft(tuple(tail))
        return Draft(())


def _client(model, decode=None, **cfg) -> InProcessEngine:
    info = ModelInfo(id="tiny", family="test", context_length=4096, max_output_tokens=1024)
    cfg.setdefault("prefill_chunk", 64)
    cfg.setdefault("prefix_cache_bytes", 0)
    return InProcessEngine(
        model, ByteTokenizer(), info, eos_token_ids={EOS}, config=EngineConfig(**cfg), decode=decode
    )


async def _run(client, prompt: str, *, n: int = N_TOKENS, **sampling) -> tuple[list[int], str, FinishEvent]:
    ids, text, finish = [], [], None
    params = SamplingParams(max_tokens=n, ignore_eos=True, **sampling)
    async for event in client.generate(GenerationRequest(prompt=prompt, sampling=params)):
        if isinstance(event, TokenEvent):
            ids += event.token_ids
            text.append(event.text)
        elif isinstance(event, FinishEvent):
            finish = event
    return ids, "".join(text), finish


async def _plain_outputs(model) -> list[list[int]]:
    client = _client(model)
    try:
        return [(await _run(client, p))[0] for p in PROMPTS]
    finally:
        client.close()


async def _alone_and_batched(model, strategy) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy outputs of PROMPTS run one by one, then all at once, through `strategy`."""
    client = _client(model, strategy)
    try:
        alone = [(await _run(client, p))[0] for p in PROMPTS]
        together = await asyncio.gather(*(_run(client, p) for p in PROMPTS))
    finally:
        client.close()
    return alone, [ids for ids, _, _ in together]


def _references(plain: list[list[int]]) -> dict[tuple[int, ...], list[int]]:
    tok = ByteTokenizer()
    return {tuple(tok.encode(p)): ids for p, ids in zip(PROMPTS, plain, strict=True)}


@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h"])
async def test_greedy_speculation_equals_plain_alone_and_batched(kind: str) -> None:
    model = tiny_model(kind)
    plain = await _plain_outputs(model)
    refs = _references(plain)
    strategies = [
        SpeculativeDecode(lambda: OracleDrafter(refs, seed=1), name="oracle", max_draft=5, adaptive=False),
        make_decode_strategy("ngram", draft_tokens=6),
    ]
    for strategy in strategies:
        alone, together = await _alone_and_batched(model, strategy)
        assert alone == plain, strategy.name
        assert together == plain, strategy.name
    oracle = strategies[0].stats
    assert oracle.accepted > 0 and oracle.tokens_per_step > 1.2  # drafts really were accepted


@PADDING
@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h"])
async def test_draft_model_drafter_equals_plain(kind: str, widths) -> None:
    model = tiny_model(kind)
    plain = await _plain_outputs(model)
    # The target drafting for itself accepts everything; output must still be the plain one.
    strategy = make_decode_strategy("draft", draft_model=model, draft_tokens=4)
    strategy.verify_widths = widths
    client = _client(model, strategy)
    try:
        got = [(await _run(client, p))[0] for p in PROMPTS]
    finally:
        client.close()
    assert got == plain
    assert strategy.stats.acceptance_rate > 0.95


async def test_stop_string_inside_an_accepted_block() -> None:
    model = tiny_model("qwen3_5")
    client = _client(model)
    try:
        _, plain_text, _ = await _run(client, PROMPTS[0])
    finally:
        client.close()
    stop = plain_text[9:12]
    assume_cut = plain_text[: plain_text.find(stop)]
    refs = _references(await _plain_outputs(model))
    client = _client(
        model, SpeculativeDecode(lambda: OracleDrafter(refs, seed=3), max_draft=8, adaptive=False)
    )
    try:
        _, text, finish = await _run(client, PROMPTS[0], stop=(stop,))
    finally:
        client.close()
    assert text == assume_cut
    assert finish.finish_reason == "stop" and finish.stop_sequence == stop


async def test_broken_rollback_is_caught(monkeypatch) -> None:
    """Negative control: keep the drafts' recurrent state (skip the replay) and outputs diverge."""
    model = tiny_model("qwen3_5")
    plain = await _plain_outputs(model)
    refs = _references(plain)

    def rollback_without_replay(self: HybridCache, n) -> None:
        drop = [n] * self.batch_size if isinstance(n, int) else list(n)
        self.offsets = [o - d for o, d in zip(self.offsets, drop, strict=True)]
        self.commit()

    monkeypatch.setattr(HybridCache, "rollback", rollback_without_replay)
    client = _client(
        model, SpeculativeDecode(lambda: OracleDrafter(refs, seed=1), max_draft=5, adaptive=False)
    )
    try:
        got = [(await _run(client, p))[0] for p in PROMPTS]
    finally:
        client.close()
    assert got != plain


async def test_seeded_speculative_sampling_is_reproducible() -> None:
    model = tiny_model("nemotron_h")
    outs = []
    for _ in range(2):
        client = _client(model, make_decode_strategy("ngram", draft_tokens=4))
        try:
            outs.append((await _run(client, PROMPTS[1], temperature=0.8, seed=11))[0])
        finally:
            client.close()
    assert outs[0] == outs[1] and len(outs[0]) == N_TOKENS


def test_unknown_and_unavailable_modes_are_clear_errors() -> None:
    with pytest.raises(InvalidRequest, match="unknown speculative mode"):
        make_decode_strategy("fast")
    with pytest.raises(InvalidRequest, match="needs --draft"):
        make_decode_strategy("draft")


@PADDING
async def test_mtp_drafter_equals_plain(tmp_path, widths) -> None:
    from kapitsa.engine.loading.loader import load_model
    from kapitsa.testing.tiny import write_tiny_checkpoint

    loaded = load_model(write_tiny_checkpoint(tmp_path / "q", "qwen3_5", mtp=True))
    model = loaded.model
    assert model.mtp is not None
    plain = await _plain_outputs(model)
    # `auto` leaves the MTP head alone (it can't rest while it doesn't pay): it is asked for by name
    assert make_decode_strategy("auto", target_model=model).name == "ngram"
    strategy = make_decode_strategy("mtp", target_model=model)
    strategy.verify_widths = widths
    assert strategy.name == "mtp"
    alone, together = await _alone_and_batched(model, strategy)
    assert alone == plain
    assert together == plain
    assert strategy.stats.proposed > 0


async def test_nemotron_mtp_drafter_equals_plain() -> None:
    from tests.models.builders import build_ours

    model = build_ours("nemotron_moe", mtp=True)
    plain = await _plain_outputs(model)
    strategy = make_decode_strategy("mtp", target_model=model)
    alone, together = await _alone_and_batched(model, strategy)
    assert alone == plain and together == plain
    assert strategy.stats.proposed > 0


def _write_dflash(folder, hidden: int, target_layers: list[int], mask_token_id: int) -> None:
    import json

    import mlx.core as mx
    from mlx.utils import tree_flatten

    from kapitsa.engine.speculative.dflash import DFlashConfig, DFlashModel

    cfg = {
        "architectures": ["DFlashDraftModel"],
        "hidden_size": hidden,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 96,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "block_size": 6,
        "num_target_layers": 4,
        "dflash_config": {"target_layer_ids": target_layers, "mask_token_id": mask_token_id},
    }
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    mx.random.seed(5)
    model = DFlashModel(DFlashConfig.from_dict(cfg))
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))


@PADDING
@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h"])
async def test_block_drafter_equals_plain(kind: str, tmp_path, widths) -> None:
    from kapitsa.engine.speculative.dflash import load_dflash

    model = tiny_model(kind)
    plain = await _plain_outputs(model)
    _write_dflash(tmp_path / "dflash", hidden=64, target_layers=[1, 2], mask_token_id=2)
    drafter = load_dflash(tmp_path / "dflash")
    strategy = make_decode_strategy("block", target_model=model, block_drafter=drafter)
    strategy.verify_widths = widths
    alone, together = await _alone_and_batched(model, strategy)
    assert alone == plain
    assert together == plain
    assert strategy.stats.proposed > 0


@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h"])
async def test_block_drafter_best_first_tree_equals_plain(kind: str, tmp_path) -> None:
    from kapitsa.engine.speculative.dflash import load_dflash

    model = tiny_model(kind)
    plain = await _plain_outputs(model)
    _write_dflash(tmp_path / "dflash", hidden=64, target_layers=[1, 2], mask_token_id=2)
    drafter = load_dflash(tmp_path / "dflash")
    strategy = make_decode_strategy("block", target_model=model, block_drafter=drafter, tree=True)
    assert strategy.tree
    alone, together = await _alone_and_batched(model, strategy)
    assert alone == plain and together == plain
    assert strategy.stats.proposed > 0


def test_dflash_checkpoint_errors_are_clear(tmp_path) -> None:
    from kapitsa.engine.speculative.dflash import load_dflash
    from kapitsa.errors import CheckpointError

    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="not a DFlash drafter"):
        load_dflash(tmp_path / "empty")


class OracleTreeDrafter(OracleDrafter):
    """Two branches: a corrupted copy of the known continuation and a truncated correct one, so
    acceptance has to leave the first branch for the second at varying depths."""

    def propose_tree(self, context, budget: int):
        from kapitsa.engine.speculative.tree import tree_from_paths

        wrong = list(self.propose(context, budget).tokens)
        for prompt, ref in self.references.items():
            if tuple(context[: len(prompt)]) == prompt:
                done = len(context) - len(prompt)
                right = list(ref[done : done + self.rng.randint(0, max(0, budget // 2))])
                return tree_from_paths(context[-1], [wrong, right], budget=budget)
        return tree_from_paths(context[-1], [wrong], budget=budget)


@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h"])
async def test_tree_verification_equals_plain(kind: str) -> None:
    model = tiny_model(kind)
    plain = await _plain_outputs(model)
    refs = _references(plain)
    strategies = [
        SpeculativeDecode(
            lambda: OracleTreeDrafter(refs, seed=2),
            name="oracle-tree",
            max_draft=6,
            adaptive=False,
            tree=True,
        ),
        make_decode_strategy("ngram", draft_tokens=6, tree=True),
        make_decode_strategy("draft", draft_model=model, draft_tokens=5, tree=True),
        # trees padded up to verify widths, as on a GPU: the padding leaves are never accepted
        SpeculativeDecode(
            lambda: OracleTreeDrafter(refs, seed=3),
            name="oracle-tree-padded",
            max_draft=6,
            adaptive=False,
            tree=True,
            verify_widths=(2, 4, 8),
        ),
    ]
    widths: dict[str, set[int]] = {}
    forward = model.forward

    def forward_noting_tree_widths(x, *args, **kwargs):  # noqa: ANN001, ANN202
        if kwargs.get("parents") is not None:
            widths.setdefault(strategy.name, set()).add(x.shape[1])
        return forward(x, *args, **kwargs)

    model.forward = forward_noting_tree_widths
    for strategy in strategies:
        alone, together = await _alone_and_batched(model, strategy)
        assert alone == plain, strategy.name
        assert together == plain, strategy.name
    assert strategies[0].stats.accepted > 0
    # the draft model is the target: its top candidate at the root is in every tree and always kept
    assert strategies[2].stats.tokens_per_step > 2.0
    assert strategies[3].stats.accepted > 0
    # 7: max_draft + 1; unpadded, the same drafter's trees take other widths too
    assert widths["oracle-tree-padded"] <= {2, 4, 7} and widths["oracle-tree"] - {2, 4, 7}


async def test_tree_sampling_is_seeded() -> None:
    model = tiny_model("qwen3_5")
    outs = []
    for _ in range(2):
        client = _client(model, make_decode_strategy("draft", draft_model=model, draft_tokens=4, tree=True))
        try:
            outs.append((await _run(client, PROMPTS[0], temperature=0.9, seed=5))[0])
        finally:
            client.close()
    assert outs[0] == outs[1] and len(outs[0]) == N_TOKENS


def test_strategy_for_loads_drafters_by_kind(tmp_path) -> None:
    from kapitsa.engine.speculative.factory import strategy_for
    from kapitsa.testing.tiny import write_tiny_checkpoint

    target = tiny_model("qwen3_5")
    _write_dflash(tmp_path / "dflash", hidden=64, target_layers=[1, 2], mask_token_id=2)
    small = write_tiny_checkpoint(tmp_path / "small", "qwen3_5")
    assert strategy_for("auto", target_model=target, draft=str(tmp_path / "dflash")).name == "block"
    assert strategy_for("draft", target_model=target, draft=str(small), tree=True).tree
    with pytest.raises(InvalidRequest, match="not a DFlash"):
        strategy_for("block", target_model=target, draft=str(small))
    with pytest.raises(InvalidRequest, match="use --speculative block"):
        strategy_for("draft", target_model=target, draft=str(tmp_path / "dflash"))


async def test_engine_takes_a_model_with_lazy_parameters() -> None:
    """A dtype cast made on the caller's thread is still lazy when the engine thread starts."""
    import mlx.core as mx

    model = tiny_model("nemotron_h")
    model.set_dtype(mx.bfloat16)  # lazy: computed on this thread's stream only when evaluated
    client = _client(model)
    try:
        ids, _, finish = await _run(client, PROMPTS[1], n=4)
    finally:
        client.close()
    assert len(ids) == 4 and finish.finish_reason == "length"


@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h"])
async def test_resting_speculation_runs_pipelined_plain_steps(kind: str) -> None:
    """Drafts that can't pay for their verify turn speculation off; the engine then pipelines
    plain steps (the strategy sees one call per probe), and the output stays the plain one."""
    model = tiny_model(kind)
    n = 48
    client = _client(model)
    try:
        plain = [(await _run(client, p, n=n))[0] for p in PROMPTS]
    finally:
        client.close()
    never_pays = [1.0] + [50.0] * 6  # c(T) for T = 1..6: no acceptance rate beats plain decoding
    strategy = SpeculativeDecode(
        lambda: OracleDrafter(_references(plain), seed=2), name="oracle", max_draft=5, cost_curve=never_pays
    )
    client = _client(model, strategy)
    try:
        got = [(await _run(client, p, n=n))[0] for p in PROMPTS]
    finally:
        client.close()
    assert got == plain
    # per request: the first step (speculation goes off), then a 1-token probe every 16 tokens,
    # against n strategy steps per request if nothing were pipelined
    assert strategy.stats.steps <= len(PROMPTS) * (2 + n // 16)
    assert strategy.stats.proposed > 0  # the probes did draft


def test_speculation_prices_verify_steps_by_backend() -> None:
    """A GPU verify can't be pipelined, so it costs ~1.8 decode steps there (measured); on the CPU
    the bandwidth-only default applies."""
    import mlx.core as mx

    from kapitsa.engine.speculative.controller import default_cost_curve, gpu_cost_curve

    strategy = SpeculativeDecode(lambda: None, max_draft=4)
    on_gpu = mx.default_device().type == mx.DeviceType.gpu
    expected = gpu_cost_curve(4) if on_gpu else default_cost_curve(4)
    assert strategy._cost_curve() == expected
    assert gpu_cost_curve(4)[0] == 1.0 and min(gpu_cost_curve(4)[1:]) >= 1.5
    assert SpeculativeDecode(lambda: None, max_draft=1, cost_curve=[1.0, 3.0])._cost_curve() == [1.0, 3.0]


class _WidthSpy:
    """Wraps a strategy's `_pad_drafts`: records (verify width, room) per row of every forward."""

    def __init__(self, strategy: SpeculativeDecode) -> None:
        self.rows: list[tuple[int, int]] = []
        pad = strategy._pad_drafts

        def spy(sequences, drafts):
            padded = pad(sequences, drafts)
            for seq, draft in zip(sequences, padded, strict=True):
                self.rows.append((1 + len(draft), seq.max_tokens - len(seq.output_ids) - 1))
            return padded

        strategy._pad_drafts = spy


@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h"])
async def test_drafts_padded_to_verify_widths_keep_the_plain_output(kind: str) -> None:
    """With verify widths (what GPUs use), every verify forward is 2, 4 or 8 tokens wide unless a
    row's max_tokens leaves less room, padded rows never emit past max_tokens, and greedy output
    alone and batched is still the plain one."""
    model = tiny_model(kind)
    plain = await _plain_outputs(model)
    refs = _references(plain)
    strategy = SpeculativeDecode(
        lambda: OracleDrafter(refs, seed=5), name="oracle", max_draft=7, verify_widths=(2, 4, 8)
    )
    spy = _WidthSpy(strategy)
    alone, together = await _alone_and_batched(model, strategy)
    assert alone == plain and together == plain
    assert all(len(ids) == N_TOKENS for ids in alone + together)
    assert spy.rows and all(w <= room + 1 for w, room in spy.rows)  # padding stays inside max_tokens
    assert {w for w, _ in spy.rows} - {2, 4, 8} <= {w for w, room in spy.rows if w == room + 1}
    assert any(w == 8 for w, _ in spy.rows) and any(w in (2, 4) for w, _ in spy.rows)
    assert 0 < strategy.stats.accepted <= strategy.stats.proposed


def test_verify_widths_follow_max_draft_and_backend() -> None:
    import mlx.core as mx

    widths = SpeculativeDecode(lambda: None, max_draft=7, verify_widths=(2, 4, 8, 16))
    assert widths._widths() == (2, 4, 8) and widths._width_for(3) == 4 and widths._width_for(8) == 8
    assert SpeculativeDecode(lambda: None, max_draft=5, verify_widths=(2, 4, 8))._widths() == (2, 4, 6)
    assert SpeculativeDecode(lambda: None, max_draft=5, verify_widths=())._width_for(3) == 3
    on_gpu = mx.default_device().type == mx.DeviceType.gpu
    assert bool(SpeculativeDecode(lambda: None, max_draft=7)._widths()) == on_gpu  # CPU: exact widths
