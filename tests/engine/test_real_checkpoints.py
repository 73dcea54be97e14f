"""The engine over real tiny checkpoints (load_model + the checkpoint's tokenizer and chat template)."""

from __future__ import annotations

import asyncio
import json

import pytest

from kapitsa.engine.inprocess import InProcessEngine
from kapitsa.engine.loading.loader import load_model
from kapitsa.engine.options import EngineConfig
from kapitsa.engine.types import ErrorEvent, FinishEvent, GenerationRequest, SamplingParams, TokenEvent
from kapitsa.testing.tiny import write_tiny_checkpoint

SYSTEM = "You are a coding agent. " + " ".join(f"Rule {i}: be brief and precise." for i in range(60))


@pytest.fixture(scope="module", params=["qwen3_5", "nemotron_h"])
def checkpoint(request, tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp(request.param) / "ckpt", request.param)


@pytest.fixture
def client(checkpoint):
    engine = InProcessEngine.from_loaded(load_model(checkpoint), config=EngineConfig(prefill_chunk=64))
    yield engine
    engine.close()


async def chat(client, messages, n: int = 6):
    request = GenerationRequest(messages=tuple(messages), sampling=SamplingParams(max_tokens=n))
    text, ids = "", []
    async for event in client.generate(request):
        if isinstance(event, ErrorEvent):
            raise event.error
        if isinstance(event, TokenEvent):
            text, ids = text + event.text, ids + list(event.token_ids)
        if isinstance(event, FinishEvent):
            return text, ids, event.usage
    raise AssertionError("no finish event")


async def test_batched_equals_single_with_chat_template(client) -> None:
    convs = [[{"role": "user", "content": c}] for c in ("hi", "write a function " * 6, "explain json " * 3)]
    alone = [(await chat(client, m, 10))[1] for m in convs]
    together = await asyncio.gather(*(chat(client, m, 10) for m in convs))
    assert [ids for _, ids, _ in together] == alone


async def test_ten_turn_agent_conversation_reuses_its_prompt(client) -> None:
    messages = [{"role": "system", "content": SYSTEM}]
    usages = []
    for turn in range(10):
        messages.append({"role": "user", "content": f"Turn {turn}: continue."})
        text, _, usage = await chat(client, messages)
        messages.append({"role": "assistant", "content": text})
        usages.append(usage)
    later = usages[1:]
    computed = sum(u.prompt_tokens - u.cached_tokens for u in later)
    assert computed <= 0.05 * sum(u.prompt_tokens for u in later), [
        (u.prompt_tokens, u.cached_tokens) for u in later
    ]


def test_kapitsa_run_json(checkpoint, capsys) -> None:
    from kapitsa.commands.run import RunOptions, cmd_run

    result = cmd_run(RunOptions(model=str(checkpoint), prompt="Hello", max_tokens=5, json_out=True))
    printed = json.loads(capsys.readouterr().out)
    assert printed["token_ids"] == result.token_ids and len(result.token_ids) == result.generation_tokens
    assert {
        "text",
        "token_ids",
        "prompt_tokens",
        "generation_tokens",
        "prefill_tok_s",
        "decode_tok_s",
    } <= set(printed)
    assert printed["prompt_tokens"] > 1 and printed["generation_tokens"] <= 5
    streamed = []
    again = cmd_run(
        RunOptions(model=str(checkpoint), prompt_arg="Hello", max_tokens=5), write=streamed.append
    )
    assert "".join(streamed).rstrip("\n") == again.text and again.token_ids == result.token_ids


def test_kapitsa_run_exits_cleanly() -> None:
    """The process ends with status 0 after the engine stops (no abort from MLX's thread teardown)."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "kapitsa", "run", "--model", "demo", "--max-tokens", "3", "--json", "Hi"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["generation_tokens"] <= 3
