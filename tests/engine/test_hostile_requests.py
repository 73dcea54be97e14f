"""The engine's own edge: a caller that is not the server (TUI, bench, a script) cannot crash it with
token ids outside the vocabulary or with any integer seed; the engine keeps serving afterwards."""

from __future__ import annotations

import pytest

from kapitsa.engine.types import GenerationRequest, SamplingParams, TokenEvent
from kapitsa.errors import InvalidRequest

TINY_VOCAB = 512  # tiny_config's embedding rows


async def _tokens(client, request: GenerationRequest) -> list[int]:
    return [t async for e in client.generate(request) if isinstance(e, TokenEvent) for t in e.token_ids]


def _ids(ids: list, **sampling) -> GenerationRequest:
    return GenerationRequest(
        prompt_token_ids=tuple(ids), sampling=SamplingParams(max_tokens=2, ignore_eos=True, **sampling)
    )


BAD_REQUESTS = {
    "beyond the vocabulary": _ids([5, 99_999_999]),
    "just past the last row": _ids([TINY_VOCAB]),
    "negative": _ids([-5]),
    "beyond int32": _ids([2**40]),
    "a bool": _ids([True]),
    "a float": _ids([3.0]),
    "logit bias beyond the vocabulary": _ids([5], logit_bias=((TINY_VOCAB, 1.0),)),
    "negative logit bias id": _ids([5], logit_bias=((-1, 1.0),)),
    "stop id beyond the vocabulary": _ids([5], stop_token_ids=(10**9,)),
}


async def test_the_vocabulary_is_read_from_the_model(qwen_model, make_client) -> None:
    assert make_client(qwen_model).models()[0].vocab_size == TINY_VOCAB


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
async def test_out_of_range_token_ids_are_refused_not_run(qwen_model, make_client, name) -> None:
    client = make_client(qwen_model)
    with pytest.raises(InvalidRequest, match="no token id"):
        await _tokens(client, BAD_REQUESTS[name])
    assert len(await _tokens(client, _ids([5, TINY_VOCAB - 1]))) == 2  # the last row is fine
    assert client.stats().alive and client.stats().requests_failed == 0


@pytest.mark.parametrize("seed", [-1, 2**64, 2**70, -(2**80)])
async def test_any_integer_seed_samples_as_its_residue_modulo_2_64(qwen_model, make_client, seed) -> None:
    client = make_client(qwen_model)
    sampled = _ids([5, 6, 7], temperature=1.0, seed=seed)
    residue = _ids([5, 6, 7], temperature=1.0, seed=seed % 2**64)
    assert await _tokens(client, sampled) == await _tokens(client, residue)
