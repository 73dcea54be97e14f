"""generation_config.json's `max_new_tokens` (the answer length when a request sets none) and
`exponential_decay_length_penalty` (the default `eos_decay`) reach ModelInfo and the engine."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from kapitsa.engine.inprocess import InProcessEngine
from kapitsa.engine.loading.loader import load_model
from kapitsa.engine.options import EngineConfig
from kapitsa.engine.types import FinishEvent, GenerationRequest, SamplingParams
from kapitsa.testing.tiny import write_tiny_checkpoint


def _checkpoint(tmp_path: Path, **generation: object) -> Path:
    folder = tmp_path / "ckpt"
    write_tiny_checkpoint(folder, "qwen3_5")
    path = folder / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **generation}))
    return folder


def _finish(engine: InProcessEngine, sampling: SamplingParams) -> FinishEvent:
    async def run() -> FinishEvent:
        request = GenerationRequest(prompt_token_ids=(5, 6, 7), sampling=sampling)
        return [e async for e in engine.generate(request) if isinstance(e, FinishEvent)][0]

    return asyncio.run(run())


def test_max_new_tokens_is_the_default_answer_length(tmp_path: Path) -> None:
    loaded = load_model(str(_checkpoint(tmp_path, max_new_tokens=6)))
    assert loaded.info.max_output_tokens == 6 and loaded.info.eos_decay is None
    engine = InProcessEngine.from_loaded(loaded, config=EngineConfig(prefix_cache_bytes=0))
    try:
        assert _finish(engine, SamplingParams(ignore_eos=True)).usage.completion_tokens == 6
        assert _finish(engine, SamplingParams(max_tokens=20, ignore_eos=True)).usage.completion_tokens == 20
    finally:
        engine.close()


def test_the_checkpoints_eos_decay_ends_answers(tmp_path: Path) -> None:
    loaded = load_model(str(_checkpoint(tmp_path, exponential_decay_length_penalty=[2, 4.0])))
    assert loaded.info.eos_decay == (2, 4.0)
    engine = InProcessEngine.from_loaded(loaded, config=EngineConfig(prefix_cache_bytes=0))
    try:
        ended = _finish(engine, SamplingParams(max_tokens=200))
        assert ended.finish_reason == "stop" and ended.usage.completion_tokens < 40
        assert _finish(engine, SamplingParams(max_tokens=200, ignore_eos=True)).usage.completion_tokens == 200
    finally:
        engine.close()


def test_malformed_values_are_ignored(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path, max_new_tokens="many", exponential_decay_length_penalty=[2, 0.5])
    info = load_model(str(folder)).info
    assert info.max_output_tokens == info.context_length and info.eos_decay is None
