"""Image prompts inside the engine, on tiny Qwen3.5 and Nemotron-H vision-language checkpoints: images change
the answer, chunking, batching and speculation leave it alone, and the prefix cache reuses an image
a conversation re-sends (and never a different one)."""

from __future__ import annotations

import asyncio
import io
import random

import numpy as np
import pytest
from PIL import Image

from kapitsa.engine.inprocess import InProcessEngine
from kapitsa.engine.loading.loader import load_model
from kapitsa.engine.options import EngineConfig
from kapitsa.engine.speculative.decoder import SpeculativeDecode
from kapitsa.engine.speculative.drafter import Draft
from kapitsa.engine.speculative.factory import make_decode_strategy
from kapitsa.engine.text.prepare import prepare_prompt
from kapitsa.engine.types import ErrorEvent, FinishEvent, GenerationRequest, SamplingParams, TokenEvent
from kapitsa.errors import InvalidRequest
from kapitsa.testing.tiny import write_tiny_checkpoint

N_TOKENS = 24


def png(fill: int | None = None, *, width: int = 40, height: int = 24, seed: int = 0) -> bytes:
    if fill is None:
        pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    else:
        pixels = np.full((height, width, 3), fill, dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


BLACK, WHITE, NOISE = png(0), png(255), png(seed=3)
IMAGE_TOKENS = (24 // 4) * (40 // 4) // 4  # a 40x24 image: 6x10 patches of 4 px, merged 2x2 (both families)


@pytest.fixture(scope="module", params=["qwen3_5", "nemotron_h"])
def loaded(request, tmp_path_factory):
    """Each family's tiny vision-language checkpoint (Nemotron-H: the omni layout, tiny_vision.py)."""
    folder = tmp_path_factory.mktemp("vl") / request.param
    return load_model(write_tiny_checkpoint(folder, request.param, vision=True))


def _client(loaded, decode=None, **cfg) -> InProcessEngine:  # noqa: ANN001
    cfg.setdefault("prefill_chunk", 16)  # chunks that cut through every image
    return InProcessEngine.from_loaded(loaded, config=EngineConfig(**cfg), decode=decode)


def _messages(images: tuple[bytes, ...], text: str = "Describe it.") -> tuple[dict, ...]:
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    return ({"role": "user", "content": content},)


def _request(messages, images, max_tokens: int = N_TOKENS) -> GenerationRequest:  # noqa: ANN001
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return GenerationRequest(messages=tuple(messages), images=tuple(images), sampling=sampling)


async def _run(client: InProcessEngine, request: GenerationRequest):
    ids, finish = [], None
    async for event in client.generate(request):
        if isinstance(event, TokenEvent):
            ids += event.token_ids
        elif isinstance(event, FinishEvent):
            finish = event
        elif isinstance(event, ErrorEvent):
            raise event.error
    return ids, finish.usage


PROMPTS = [  # one image, two images, an image between two texts, text only
    ((WHITE,), "Describe it."),
    ((BLACK, NOISE), "Compare them."),
    ((NOISE,), "What is this?"),
    ((), "Describe it."),
]


def _requests() -> list[GenerationRequest]:
    return [_request(_messages(images, text), images) for images, text in PROMPTS]


async def _alone(client: InProcessEngine) -> list[list[int]]:
    return [(await _run(client, r))[0] for r in _requests()]


async def _together(client: InProcessEngine) -> list[list[int]]:
    return [ids for ids, _ in await asyncio.gather(*(_run(client, r) for r in _requests()))]


async def test_the_image_decides_the_answer_and_its_tokens_are_counted(loaded) -> None:
    client = _client(loaded)
    try:
        black, black_usage = await _run(client, _request(_messages((BLACK,)), (BLACK,)))
        white, _ = await _run(client, _request(_messages((WHITE,)), (WHITE,)))
        counted = await client.count_tokens(_request(_messages((BLACK,)), (BLACK,)))
        text_only = await client.count_tokens(_request(_messages(()), ()))
    finally:
        client.close()
    assert black != white
    # the image part renders <|vision_start|><|image_pad|><|vision_end|> (Qwen) or <image> (Nemotron,
    # which becomes <img>, the image's tokens, </img>)
    assert black_usage.prompt_tokens == counted == text_only + 2 + IMAGE_TOKENS


async def test_chunking_batching_and_speculation_equal_the_plain_answer(loaded) -> None:
    plain_client = _client(loaded, prefill_chunk=512, prefix_cache_bytes=0)
    try:
        plain = await _alone(plain_client)
    finally:
        plain_client.close()
    references = {tuple(p): out for p, out in zip(_prompt_ids(loaded), plain, strict=True)}
    strategies = [
        None,
        SpeculativeDecode(
            lambda: _CorruptedReference(references), name="oracle", max_draft=5, adaptive=False
        ),
        make_decode_strategy("draft", draft_model=loaded.model, draft_tokens=4, tree=True),
    ]
    for strategy in strategies:
        client = _client(loaded, decode=strategy, prefix_cache_bytes=0)
        try:
            assert await _alone(client) == plain, getattr(strategy, "name", "plain")
            assert await _together(client) == plain, getattr(strategy, "name", "plain")
        finally:
            client.close()
    assert strategies[1].stats.accepted > 0  # drafts were accepted and rejected along image prompts


def _prompt_ids(loaded) -> list[list[int]]:  # noqa: ANN001
    return [prepare_prompt(loaded.tokenizer, r, images=loaded.images).ids for r in _requests()]


def _image_span(loaded, image: bytes):  # noqa: ANN001, ANN202
    request = _request(_messages((image,)), (image,))
    return prepare_prompt(loaded.tokenizer, request, images=loaded.images).media.images[0]


class _CorruptedReference:
    """Drafts the known continuation with one token wrong 70% of the time (every accept length)."""

    name = "oracle"

    def __init__(self, references: dict[tuple[int, ...], list[int]]) -> None:
        self.references, self.rng = references, random.Random(1)

    def observe(self, new_tokens) -> None:  # noqa: ANN001
        pass

    def propose(self, context, max_tokens: int) -> Draft:  # noqa: ANN001
        for prompt, ref in self.references.items():
            if len(context) >= len(prompt) and tuple(context[: len(prompt)]) == prompt:
                done = len(context) - len(prompt)
                tail = list(ref[done : done + max_tokens])
                if tail and self.rng.random() < 0.7:
                    tail[self.rng.randrange(len(tail))] = self.rng.randrange(3, 200)
                return Draft(tuple(tail))
        return Draft(())


async def _two_turns(client: InProcessEngine, first: bytes, second: bytes):
    turn1 = list(_messages((first,)))
    answer, usage1 = await _run(client, _request(turn1, (first,)))
    reply = client.tokenizer.decode(answer)
    turn2 = [*turn1, {"role": "assistant", "content": reply}, {"role": "user", "content": "And now?"}]
    again, usage2 = await _run(client, _request(turn2, (second,)))
    return again, usage1, usage2


async def test_a_re_sent_image_reuses_its_encoding_and_the_states_after_it(loaded) -> None:
    cold = _client(loaded, prefix_cache_bytes=0)
    warm = _client(loaded)
    try:
        want, _, _ = await _two_turns(cold, NOISE, NOISE)
        got, usage1, usage2 = await _two_turns(warm, NOISE, NOISE)
        encoded = warm.engine.runner.images.num_encoded
    finally:
        cold.close()
        warm.close()
    assert got == want  # a cache hit answers as a miss does
    image = _image_span(loaded, NOISE)
    assert usage1.cached_tokens == 0 and usage1.cache_write_tokens >= image.end
    assert usage2.cached_tokens >= image.end  # the image and the text after it came from the cache
    assert encoded == 1  # the second turn's image was never encoded again


async def test_a_different_image_of_the_same_size_is_not_a_cache_hit(loaded) -> None:
    cold = _client(loaded, prefix_cache_bytes=0)
    warm = _client(loaded)
    try:
        want, _, _ = await _two_turns(cold, BLACK, WHITE)
        got, _, usage2 = await _two_turns(warm, BLACK, WHITE)
    finally:
        cold.close()
        warm.close()
    assert got == want
    assert usage2.cached_tokens <= _image_span(loaded, WHITE).start  # nothing from the image on is reused


async def test_a_text_only_model_refuses_images(tmp_path) -> None:
    text_only = load_model(write_tiny_checkpoint(tmp_path / "text", "qwen3_5"))
    assert not text_only.info.vision and text_only.images is None
    client = _client(text_only)
    try:
        with pytest.raises(InvalidRequest, match="reads text only"):
            await _run(client, _request(_messages((BLACK,)), (BLACK,)))
        with pytest.raises(InvalidRequest, match="reads text only"):
            await client.count_tokens(_request(_messages((BLACK,)), (BLACK,)))
    finally:
        client.close()


async def test_placeholders_and_images_must_agree(loaded) -> None:
    client = _client(loaded)
    try:
        with pytest.raises(InvalidRequest, match="1 image placeholders for 2 images"):
            await _run(client, _request(_messages((BLACK,)), (BLACK, WHITE)))
        with pytest.raises(InvalidRequest, match="could not be decoded"):
            await _run(client, _request(_messages((b"not an image",)), (b"not an image",)))
    finally:
        client.close()
