"""A model whose every layer is full attention (no recurrent state, no sliding window) checkpoints
message boundaries from inside a prefill chunk: K/V is positional, so its chunks run past the
boundaries (a forward fewer each, issue #29) and the checkpoints still keep the next-token logits."""

from __future__ import annotations

import mlx.core as mx
from test_prefix_reuse import SYSTEM, _sampling, chat

from kapitsa.engine.cache.snapshot import fixed_layer_ids, kv_layer_ids
from kapitsa.engine.runner.model_runner import ModelRunner
from kapitsa.engine.types import GenerationRequest, TokenEvent

CHUNK = 256


def _attention_only():
    from kapitsa.engine.models import get_model_module
    from kapitsa.testing.tiny import tiny_config

    config = tiny_config("qwen3_5", full_attention_interval=1)  # the lab's "tiny-wide-kv" layout
    module = get_model_module(config["model_type"])
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    return model


async def test_chunks_run_past_message_boundaries_and_checkpoint_them(make_client, monkeypatch) -> None:
    model = _attention_only()
    assert not fixed_layer_ids(model.make_cache(1)) and kv_layer_ids(model.make_cache(1))
    calls: list[tuple[int, list[int]]] = []
    real = ModelRunner.prefill_at

    def recording(self, cache, tokens, ends, **kw):  # noqa: ANN001, ANN202
        calls.append((len(tokens), list(ends)))
        return real(self, cache, tokens, ends, **kw)

    monkeypatch.setattr(ModelRunner, "prefill_at", recording)
    client = make_client(model, prefill_chunk=CHUNK)
    messages = ({"role": "system", "content": SYSTEM}, {"role": "user", "content": "continue this"})
    await chat(client, messages)
    # every chunk but the last is a full one: none ended at the system or the turn boundary ...
    assert len(calls) > 1 and all(n == CHUNK for n, _ in calls[:-1])
    # ... whose positions were asked for logits inside their chunks
    assert sum(len(ends) - 1 for _, ends in calls) == 2

    # a prompt ending exactly at the turn boundary computes nothing: that checkpoint kept its logits
    request = GenerationRequest(messages=messages, add_generation_prompt=False, sampling=_sampling())
    events = [e async for e in client.generate(request)]
    assert events[-1].usage.cached_tokens == events[-1].usage.prompt_tokens
    cold = [e async for e in make_client(model, prefix_cache_bytes=0).generate(request)]
    assert [t for e in events if isinstance(e, TokenEvent) for t in e.token_ids] == [
        t for e in cold if isinstance(e, TokenEvent) for t in e.token_ids
    ]
