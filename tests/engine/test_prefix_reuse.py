"""Prefix cache in the engine: hits give the same output as misses, agent conversations reuse
almost all of their prompt, and the disk tier survives a restart and corrupt files."""

from __future__ import annotations

import contextlib

import pytest
from engine_standins import OFFSET, ByteTokenizer  # noqa: I001

from kapitsa.engine.types import ErrorEvent, FinishEvent, GenerationRequest, SamplingParams, TokenEvent

SYSTEM = "You are a careful coding agent. Follow the rules below exactly.\n" + "".join(
    f"Rule {i}: keep answers short, cite file paths.\n" for i in range(20)
)
# Only printable ASCII byte tokens: the reply re-renders to the same ids, as real tokenizers mostly do.
ASCII_ONLY = tuple((i, -1e9) for i in range(512) if not OFFSET + 32 <= i < OFFSET + 127)


def _sampling(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, logit_bias=ASCII_ONLY)


async def chat(client, messages, max_tokens: int = 8):
    request = GenerationRequest(messages=tuple(messages), sampling=_sampling(max_tokens))
    text, ids, finish = "", [], None
    async for event in client.generate(request):
        if isinstance(event, TokenEvent):
            text += event.text
            ids += event.token_ids
        elif isinstance(event, FinishEvent):
            finish = event
        elif isinstance(event, ErrorEvent):
            raise event.error
    return text, ids, finish


async def replay(client, turns: int, max_tokens: int = 8):
    """An agent conversation: each request is the previous one plus the reply and a new message."""
    messages = [{"role": "system", "content": SYSTEM}]
    results = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Step {turn}: go on."})
        text, ids, finish = await chat(client, messages, max_tokens)
        messages.append({"role": "assistant", "content": text})
        results.append((ids, finish.usage))
    return results


async def test_cache_hit_output_equals_miss(family_model, make_client) -> None:
    cold = await replay(make_client(family_model, prefix_cache_bytes=0), 2)
    warm = await replay(make_client(family_model, prefill_chunk=64), 2)
    assert [ids for ids, _ in warm] == [ids for ids, _ in cold]
    assert all(u.cached_tokens == 0 for _, u in cold)
    assert all(u.cached_tokens > 0 for _, u in warm[1:])


async def test_agent_conversation_recomputes_under_5_percent(family_model, make_client) -> None:
    client = make_client(family_model, prefill_chunk=64)
    results = await replay(client, 10)
    later = [usage for _, usage in results[1:]]
    prompt = sum(u.prompt_tokens for u in later)
    computed = sum(u.prompt_tokens - u.cached_tokens for u in later)
    assert computed <= 0.05 * prompt, (computed, prompt)
    stats = client.stats()
    assert stats.prompt_tokens_cached >= prompt - computed
    assert stats.checkpoints_in_memory > 0


async def test_diverging_reply_falls_back_to_the_turn_checkpoint(qwen_model, make_client) -> None:
    client = make_client(qwen_model)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}]
    text, _, first = await chat(client, messages)
    # the agent rewrites the reply (as thinking templates drop reasoning): the final checkpoint misses
    messages += [
        {"role": "assistant", "content": "something else entirely"},
        {"role": "user", "content": "next"},
    ]
    _, ids, second = await chat(client, messages)
    assert second.usage.cached_tokens == first.usage.prompt_tokens - len(
        ByteTokenizer().encode("<|im_start|>assistant\n")
    )
    cold_ids = (await chat(make_client(qwen_model, prefix_cache_bytes=0), messages))[1]
    assert ids == cold_ids


async def test_siblings_share_a_branch_checkpoint(qwen_model, make_client) -> None:
    client = make_client(qwen_model)
    base = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "shared question " * 20}]
    await chat(client, base)
    # two sub-agents fork from inside the first reply's prompt: the second reuses the fork point
    fork_a = [base[0], {"role": "user", "content": "shared question " * 20 + "variant A"}]
    fork_b = [base[0], {"role": "user", "content": "shared question " * 20 + "variant B"}]
    _, _, a = await chat(client, fork_a)
    _, _, b = await chat(client, fork_b)
    assert b.usage.cached_tokens > a.usage.cached_tokens


async def test_disk_tier_restart_and_corrupt_file(family_model, make_client, tmp_path) -> None:
    first = make_client(family_model, disk_cache_dir=tmp_path, model_key="tiny-a")
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
    text, _, _ = await chat(first, messages)
    first.close()
    files = sorted(tmp_path.rglob("*.safetensors"))
    assert files
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "more"}]
    restarted = make_client(family_model, disk_cache_dir=tmp_path, model_key="tiny-a")
    _, ids, usage_finish = await chat(restarted, messages)
    assert usage_finish.usage.cached_tokens > len(SYSTEM)
    assert restarted.stats().checkpoints_on_disk >= 1
    cold_ids = (await chat(make_client(family_model, prefix_cache_bytes=0), messages))[1]
    assert ids == cold_ids
    restarted.close()
    stored = list(tmp_path.rglob("*.safetensors"))
    for path in stored:
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])  # header survives, tensor data does not
    damaged = make_client(family_model, disk_cache_dir=tmp_path, model_key="tiny-a")
    _, ids, finish = await chat(damaged, messages)
    assert finish.finish_reason == "length" and ids == cold_ids
    assert finish.usage.cached_tokens == 0
    # the corrupt files this prompt reached were deleted (others wait until a prompt reaches them)
    assert len(list(tmp_path.rglob("*.safetensors"))) < len(stored)


@pytest.mark.parametrize("budget_files", [1])
async def test_disk_tier_budget(qwen_model, make_client, tmp_path, budget_files) -> None:
    probe = make_client(qwen_model, disk_cache_dir=tmp_path / "probe", model_key="m")
    await chat(probe, [{"role": "user", "content": "x" * 300}])
    probe.close()
    one_file = max(p.stat().st_size for p in (tmp_path / "probe").rglob("*.safetensors"))
    budget = int(one_file * (budget_files + 0.5))
    client = make_client(
        qwen_model,
        disk_cache_dir=tmp_path / "b",
        model_key="m",
        disk_cache_bytes=budget,
        prefix_cache_bytes=1,
    )
    for i in range(4):
        await chat(client, [{"role": "user", "content": f"{i}" * 300}])
        assert _stored_bytes(tmp_path / "b") <= budget


def _stored_bytes(folder) -> int:
    """Bytes of the disk tier's files; the engine thread may evict one between the listing and
    its stat (seen once as a FileNotFoundError), which counts as gone."""
    total = 0
    for path in folder.rglob("*.safetensors"):
        with contextlib.suppress(FileNotFoundError):
            total += path.stat().st_size
    return total


async def test_exact_hit_resumes_from_stored_logits(qwen_model, make_client) -> None:
    """A prompt that ends exactly at a checkpoint (here the turn boundary) computes nothing."""
    messages = ({"role": "system", "content": SYSTEM}, {"role": "user", "content": "continue this"})
    client = make_client(qwen_model)
    await chat(client, messages)
    request = GenerationRequest(messages=messages, add_generation_prompt=False, sampling=_sampling())
    events = [e async for e in client.generate(request)]
    cold_client = make_client(qwen_model, prefix_cache_bytes=0)
    cold = [e async for e in cold_client.generate(request)]
    ids = [t for e in events if isinstance(e, TokenEvent) for t in e.token_ids]
    assert ids == [t for e in cold if isinstance(e, TokenEvent) for t in e.token_ids]
    assert events[-1].usage.cached_tokens == events[-1].usage.prompt_tokens


async def test_long_generation_leaves_periodic_checkpoints(qwen_model, make_client) -> None:
    """A later request that shares most of a long reply (but not its end) resumes inside it."""
    client = make_client(qwen_model, checkpoint_interval=16)
    request = GenerationRequest(
        prompt="tell me everything", sampling=SamplingParams(max_tokens=40, ignore_eos=True)
    )
    ids = [
        t
        for e in [e async for e in client.generate(request)]
        if isinstance(e, TokenEvent)
        for t in e.token_ids
    ]
    prompt_ids = ByteTokenizer().encode("tell me everything")
    follow = GenerationRequest(prompt_token_ids=tuple(prompt_ids + ids[:35] + [7, 7]), sampling=_sampling(4))
    events = [e async for e in client.generate(follow)]
    shared = len(prompt_ids) + 35
    assert events[-1].usage.cached_tokens == shared // 16 * 16  # the deepest periodic checkpoint in it
    cold_client = make_client(qwen_model, prefix_cache_bytes=0)
    cold = [e async for e in cold_client.generate(follow)]
    assert [e.token_ids for e in events if isinstance(e, TokenEvent)] == [
        e.token_ids for e in cold if isinstance(e, TokenEvent)
    ]
