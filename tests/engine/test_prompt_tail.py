"""The prefill keeps the prompt's last positions for drafters that read the target (MTP heads,
block drafters), and the speculative decoder hands them over before the first draft."""

from __future__ import annotations

import asyncio

import mlx.core as mx
import pytest
from engine_standins import EOS, ByteTokenizer, tiny_model  # noqa: I001

from kapitsa.engine.inprocess import InProcessEngine
from kapitsa.engine.options import EngineConfig
from kapitsa.engine.runner.model_runner import ModelRunner
from kapitsa.engine.runner.prompt_tail import PromptTail, TailRequest
from kapitsa.engine.speculative.decoder import SpeculativeDecode
from kapitsa.engine.speculative.drafter import Draft
from kapitsa.engine.types import GenerationRequest, ModelInfo, SamplingParams, TokenEvent

PROMPT = "def add(x, y):\n    return x + y\n"  # 33 byte tokens


def test_keep_holds_the_last_window_rows_of_the_chunks() -> None:
    tail = PromptTail(TailRequest(normed=True, taps=(3,), window=5))
    rows = mx.arange(12, dtype=mx.float32)[:, None]
    for start, end in [(0, 3), (3, 4), (4, 10), (10, 12)]:
        cut = max(start, end - 5)  # the runner hands at most `window` rows of a chunk
        tail.keep(end, rows[cut:end], {3: -rows[cut:end]})
    assert (tail.start, tail.length) == (7, 5)
    assert tail.normed[:, 0].tolist() == [7, 8, 9, 10, 11]
    assert tail.taps[3][:, 0].tolist() == [-7, -8, -9, -10, -11]
    assert tail.next_tokens(list(range(100, 112)), 999) == [108, 109, 110, 111, 999]


def test_a_tail_that_does_not_follow_starts_over() -> None:
    tail = PromptTail(TailRequest(normed=True, window=8))
    tail.keep(4, mx.zeros((4, 2)), {})
    tail.keep(9, mx.ones((2, 2)), {})  # positions 7 and 8: 4..6 were never handed over
    assert (tail.start, tail.length) == (7, 2)
    with pytest.raises(ValueError, match="window"):
        TailRequest(window=0)


@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h"])
def test_a_chunked_prefill_keeps_the_whole_prompts_last_rows(kind: str) -> None:
    model = tiny_model(kind)
    runner = ModelRunner(model)
    ids = [(7 * i + 3) % 200 + 3 for i in range(20)]
    tail = PromptTail(TailRequest(normed=True, taps=(0, 2), window=9), prompt_end=20)
    cache = runner.new_cache()
    for start in range(0, 20, 7):
        chunk = ids[start : start + 7]
        runner.prefill_at(cache, chunk, [start + len(chunk)], start=start, tail=tail)
        if start == 0:  # positions 0-6 all come a window before the prompt's end: nothing kept
            assert tail.length == 0 and not tail.wants(7) and tail.wants(14)
    whole = model.forward(mx.array([ids]), taps=(0, 2))
    assert (tail.start, tail.length) == (11, 9)
    assert mx.allclose(tail.normed, model.final_norm(whole.hidden)[0, 11:], atol=1e-4).item()
    for layer in (0, 2):
        assert mx.allclose(tail.taps[layer], whole.taps[layer][0, 11:], atol=1e-4).item()


class RecordingDrafter:
    """Reads the target's normed hidden states and layer 1's outputs; proposes nothing; records
    what it is handed and the context of its first proposal."""

    name = "recording"
    needs_hidden = True
    tap_layers = (1,)

    def __init__(self, log: list) -> None:
        self.log = log
        self.handed: list[tuple[mx.array, list[int], dict]] = []
        self.first_context: list[int] | None = None
        log.append(self)

    def observe(self, new_tokens) -> None:
        pass

    def after_verify(self, hidden, tokens, taps) -> None:
        self.handed.append((hidden, list(tokens), taps))

    def propose(self, context, max_tokens: int) -> Draft:
        if self.first_context is None:
            self.first_context = list(context)
        return Draft(())


def _engine(model, decode, **cfg) -> InProcessEngine:
    info = ModelInfo(id="tiny", family="test", context_length=4096, max_output_tokens=64)
    config = EngineConfig(prefill_chunk=cfg.pop("prefill_chunk", 16), prefix_cache_bytes=0, **cfg)
    return InProcessEngine(model, ByteTokenizer(), info, eos_token_ids={EOS}, config=config, decode=decode)


async def _generate(client: InProcessEngine, prompt: str, tokens: int, n: int = 1) -> list[int]:
    ids: list[int] = []
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    async for event in client.generate(GenerationRequest(prompt=prompt, sampling=params, n=n)):
        if isinstance(event, TokenEvent):
            ids += event.token_ids
    return ids


@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h"])
def test_the_first_draft_sees_the_prompts_rows(kind: str) -> None:
    model = tiny_model(kind)
    drafters: list[RecordingDrafter] = []
    decode = SpeculativeDecode(
        lambda: RecordingDrafter(drafters), name="recording", max_draft=2, adaptive=False
    )
    assert decode.prompt_tail_request == TailRequest(normed=True, taps=(1,))
    client = _engine(model, decode)
    try:
        asyncio.run(_generate(client, PROMPT, 4))
    finally:
        client.close()
    served = [d for d in drafters if d.first_context is not None]
    assert len(served) == 1
    drafter = served[0]
    *prompt, first = drafter.first_context
    hidden, tokens, taps = drafter.handed[0]  # before any verify: the prompt's rows
    assert tokens == [*prompt[1:], first] and hidden.shape[0] == len(prompt)
    whole = model.forward(mx.array([prompt]), taps=(1,))
    assert mx.allclose(hidden, model.final_norm(whole.hidden)[0], atol=1e-4).item()
    assert mx.allclose(taps[1], whole.taps[1][0], atol=1e-4).item()


def test_every_choice_gets_the_prompts_rows() -> None:
    model = tiny_model("qwen3_5")
    drafters: list[RecordingDrafter] = []
    decode = SpeculativeDecode(
        lambda: RecordingDrafter(drafters), name="recording", max_draft=2, adaptive=False
    )
    client = _engine(model, decode)
    try:
        asyncio.run(_generate(client, PROMPT, 4, n=2))
    finally:
        client.close()
    served = [d for d in drafters if d.first_context is not None]
    assert len(served) == 2
    for drafter in served:
        *prompt, first = drafter.first_context
        assert drafter.handed[0][1] == [*prompt[1:], first]


def test_mtp_drafts_on_the_first_step(tmp_path) -> None:
    """Before any verify the MTP head has the prompt's last hidden state and the first token:
    one token of room is one draft."""
    from kapitsa.engine.loading.loader import load_model
    from kapitsa.engine.speculative.mtp import MTPDrafter
    from kapitsa.testing.tiny import write_tiny_checkpoint

    model = load_model(write_tiny_checkpoint(tmp_path / "q", "qwen3_5", mtp=True)).model
    decode = SpeculativeDecode(lambda: MTPDrafter(model), name="mtp", max_draft=1, adaptive=False)
    plain_client = _engine(model, None)
    client = _engine(model, decode)
    try:
        plain = asyncio.run(_generate(plain_client, PROMPT, 3))
        drafted = asyncio.run(_generate(client, PROMPT, 3))
    finally:
        plain_client.close()
        client.close()
    assert drafted == plain
    assert decode.stats.proposed == 1  # step one drafts; step two has no room left
