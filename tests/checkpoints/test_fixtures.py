"""The trained test fixtures in tests/checkpoints/trained/: Nemotron-H, the Qwen3.5 draft, the bf16 MTP heads, the demo's block drafter."""

from __future__ import annotations

import json
import random

import mlx.core as mx
import pytest

from tests.checkpoints.conftest import DEMO, SNIPPET, TRAINED, safetensors_header

SIZE_BUDGET = 25_000_000
ACCEPTANCE_FLOOR = 0.10  # the demo block drafter at 3-token drafts: measured 0.175; an untrained one: 0


def test_fixtures_stay_under_the_size_budget() -> None:
    assert sum(p.stat().st_size for p in TRAINED.rglob("*") if p.is_file()) < SIZE_BUDGET


@pytest.mark.parametrize("name", ["nemotron-h", "qwen35-draft"])
def test_fixture_shares_the_demo_tokenizer(name: str) -> None:
    assert (TRAINED / name / "tokenizer.json").read_bytes() == (DEMO / "tokenizer.json").read_bytes()
    assert (TRAINED / name / "chat_template.jinja").read_text() == (DEMO / "chat_template.jinja").read_text()


def test_nemotron_config_is_published_format() -> None:
    config = json.loads((TRAINED / "nemotron-h" / "config.json").read_text())
    assert config["model_type"] == "nemotron_h"
    pattern = config["hybrid_override_pattern"]
    assert {"M", "E", "*"} <= set(pattern) and len(pattern) == len(config["layers_block_type"])
    header = safetensors_header(TRAINED / "nemotron-h" / "model.safetensors")
    assert "backbone.embeddings.weight" in header and "lm_head.weight" in header
    assert any(".mixer.experts.0.up_proj.weight" in n for n in header)
    assert any(n.endswith("mixer.gate.e_score_correction_bias") for n in header)


def test_mtp_head_file_matches_the_demo_shapes() -> None:
    header = safetensors_header(TRAINED / "qwen35-demo-mtp.safetensors")
    config = json.loads((DEMO / "config.json").read_text())
    hidden = config["hidden_size"]
    assert header["mtp.fc.weight"]["shape"] == [hidden, 2 * hidden]
    assert header["mtp.norm.weight"]["shape"] == [hidden]
    assert all(n.startswith("mtp.") and v["dtype"] == "BF16" for n, v in header.items())


def _nll(model, ids: list[int]) -> float:
    x = mx.array([ids])
    logits = model(x).astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return float(-mx.take_along_axis(logp[0, :-1], x[0, 1:, None], axis=-1).mean())


@pytest.mark.parametrize(("name", "bound"), [("nemotron-h", 4.0), ("qwen35-draft", 3.5)])
def test_fixture_loads_in_kapitsa_and_is_trained(name: str, bound: float) -> None:
    from kapitsa.engine.loading.loader import load_model

    loaded = load_model(TRAINED / name)
    ids = loaded.tokenizer.encode(SNIPPET)
    shuffled = ids[:]
    random.Random(0).shuffle(shuffled)
    trained = _nll(loaded.model, ids)
    assert trained < bound
    assert _nll(loaded.model, shuffled) > trained + 3


@pytest.mark.slow
@pytest.mark.parametrize("name", ["nemotron-h", "qwen35-draft"])
def test_transformers_reads_the_fixture_like_kapitsa(name: str) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import numpy as np

    from kapitsa.engine.loading.loader import load_model

    loaded = load_model(TRAINED / name, quantize="fp32")
    ids = loaded.tokenizer.encode(SNIPPET)
    ours = np.array(loaded.model(mx.array([ids])).astype(mx.float32))[0]
    reference = transformers.AutoModelForCausalLM.from_pretrained(TRAINED / name, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = reference(torch.tensor([ids])).logits[0].numpy()
    assert (ours.argmax(-1) == theirs.argmax(-1)).mean() > 0.95
    assert np.abs(ours - theirs).max() < 0.1


def test_nemotron_mtp_head_is_published_format() -> None:
    """tools/train_mtp_head.py's head, under the names NVIDIA's MTP checkpoints use (one tensor per
    expert), in the fixture folder the loader reads whole."""
    config = json.loads((TRAINED / "nemotron-h" / "config.json").read_text())
    header = safetensors_header(TRAINED / "nemotron-h" / "mtp.safetensors")
    hidden, experts = config["hidden_size"], config["n_routed_experts"]
    assert header["mtp.layers.0.eh_proj.weight"]["shape"] == [hidden, 2 * hidden]
    last = len(config["mtp_layers_block_type"]) - 1
    assert f"mtp.layers.{last}.final_layernorm.weight" in header
    assert all(f"mtp.layers.1.mixer.experts.{e}.up_proj.weight" in header for e in range(experts))
    assert all(n.startswith("mtp.") and v["dtype"] == "BF16" for n, v in header.items())


def test_nemotron_mtp_head_agrees_with_the_target() -> None:
    """The trained head's draft for token t+2 equals the target's own greedy token there far more
    often than an untrained head's (~0)."""
    from kapitsa.engine.loading.loader import load_model

    loaded = load_model(TRAINED / "nemotron-h")
    model = loaded.model
    assert model.mtp is not None
    ids = loaded.tokenizer.encode(SNIPPET)
    x = mx.array([ids])
    hidden = model.final_norm(model.forward(x).hidden)
    drafted = model.mtp_logits(model.mtp_forward(x[:, 1:], hidden[:, :-1])).argmax(-1)[0]  # token t+2
    wanted = model.logits(model.forward(x).hidden).argmax(-1)[0, 1:]  # the target's own token t+2
    agreement = (drafted == wanted).astype(mx.float32).mean().item()
    assert agreement > 0.4  # measured 0.64 on this snippet


ASKS = (
    "Complete this function:\n\ndef read_lines(path, encoding='utf-8'):\n",
    f"Explain this code:\n\n{SNIPPET}",
)


def _greedy_answers(loaded, decode) -> list[list[int]]:  # noqa: ANN001 - a LoadedModel, a SpeculativeDecode or None
    """The engine's greedy answers (48 tokens) to `ASKS`, one request at a time."""
    import asyncio

    from kapitsa.engine.inprocess import InProcessEngine
    from kapitsa.engine.options import EngineConfig
    from kapitsa.engine.types import GenerationRequest, SamplingParams, TokenEvent

    async def answer(engine: InProcessEngine, prompt: str) -> list[int]:
        request = GenerationRequest(
            messages=({"role": "user", "content": prompt},), sampling=SamplingParams(max_tokens=48)
        )
        return [i async for e in engine.generate(request) if isinstance(e, TokenEvent) for i in e.token_ids]

    engine = InProcessEngine.from_loaded(loaded, config=EngineConfig(prefix_cache_bytes=0), decode=decode)
    try:
        return [asyncio.run(answer(engine, p)) for p in ASKS]
    finally:
        engine.close()


def test_nemotron_mtp_drafts_are_accepted_and_exact() -> None:
    """Through the engine: greedy decoding with the head's one-token drafts gives plain decoding's
    tokens, and the target accepts a good share of the drafts on answers to chat prompts."""
    from kapitsa.engine.loading.loader import load_model
    from kapitsa.engine.speculative.decoder import SpeculativeDecode
    from kapitsa.engine.speculative.mtp import MTPDrafter

    loaded = load_model(TRAINED / "nemotron-h")
    plain = _greedy_answers(loaded, None)
    decode = SpeculativeDecode(lambda: MTPDrafter(loaded.model), name="mtp", max_draft=1, adaptive=False)
    assert _greedy_answers(loaded, decode) == plain
    # measured 0.92 (the tiny model's answers repeat themselves); an untrained head's are near 0
    assert decode.stats.acceptance_rate > 0.5


def test_demo_block_drafter_loads_as_a_dflash_drafter() -> None:
    """tools/train_block_drafter.py's drafter for the demo, in the layout `load_dflash` reads."""
    from kapitsa.engine.speculative.dflash import load_dflash

    drafter = load_dflash(TRAINED / "demo-block")
    demo = json.loads((DEMO / "config.json").read_text())
    assert drafter.config.hidden_size == demo["hidden_size"]
    assert all(0 <= i < demo["num_hidden_layers"] for i in drafter.config.target_layer_ids)
    header = safetensors_header(TRAINED / "demo-block" / "model.safetensors")
    assert all(v["dtype"] == "BF16" for v in header.values())


def test_demo_block_drafts_are_accepted_and_exact() -> None:
    """Through the engine: greedy decoding with the block drafter's drafts gives plain decoding's
    tokens, and the demo accepts a share of them on answers to chat prompts (an untrained drafter's:
    none)."""
    from kapitsa.engine.loading.loader import load_model
    from kapitsa.engine.speculative.decoder import SpeculativeDecode
    from kapitsa.engine.speculative.dflash import DFlashDrafter, load_dflash

    loaded = load_model(DEMO)
    drafter = load_dflash(TRAINED / "demo-block")
    plain = _greedy_answers(loaded, None)
    decode = SpeculativeDecode(
        lambda: DFlashDrafter(drafter, loaded.model), name="block", max_draft=3, adaptive=False
    )
    assert _greedy_answers(loaded, decode) == plain
    assert decode.stats.acceptance_rate > ACCEPTANCE_FLOOR
