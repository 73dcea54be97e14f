"""Vision-language models against mlx-vlm 0.7.10: the same HF-named weights through each side's
sanitize, the same images through each side's processor, prompts with one and with two images."""

from __future__ import annotations

import io

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

from kapitsa.engine.models import get_model_module
from kapitsa.engine.runner.vision import ImageFeatures
from kapitsa.engine.vision.qwen import QwenImages, QwenImageSettings
from kapitsa.testing import tiny
from kapitsa.testing.tiny_tokenizer import token_ids

QWEN_KINDS = ("qwen3_5", "qwen3_5_moe")
# the tiny checkpoints' processor budget (kapitsa.testing.tiny.tiny_preprocessor_config)
SETTINGS = dict(patch_size=4, min_pixels=16 * 16, max_pixels=64 * 64)
TOKENS = token_ids("qwen")
PAD, START, END = TOKENS["<|image_pad|>"], TOKENS["<|vision_start|>"], TOKENS["<|vision_end|>"]
ONE_IMAGE = [3, 17, START, PAD, END, 42, 99, 7]
TWO_IMAGES = [3, 17, START, PAD, END, 42, 99, START, PAD, END, 7, 8, 9]
CHUNK = 8  # our prefill in chunks that cut through the images; mlx-vlm's in one forward


def png(width: int, height: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


IMAGES = (png(40, 24, 1), png(30, 30, 2))


def _weights(kind: str) -> tuple[dict, dict]:
    config = tiny.tiny_config(kind)
    return config, tiny.tiny_weights(config, vision=True)


def build_ours(kind: str):
    config, hf = _weights(kind)
    module = get_model_module(config["model_type"])
    model = module.Model(module.ModelArgs.from_dict(config))
    model.load_weights(list(model.sanitize({k: mx.array(v) for k, v in hf.items()}).items()), strict=True)
    mx.eval(model.parameters())
    return model


def build_mlx_vlm(kind: str):
    import importlib

    module = importlib.import_module(f"mlx_vlm.models.{kind}")
    config, hf = _weights(kind)
    model = module.Model(module.ModelConfig.from_dict(config))
    # as mlx_vlm.utils.load does: the model's sanitize, then the vision tower's
    weights = model.vision_tower.sanitize(model.sanitize({k: mx.array(v) for k, v in hf.items()}))
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    return model


def ours_greedy(model, ids: list[int], images: tuple[bytes, ...], n: int):  # noqa: ANN001
    """Prefill in CHUNK-token pieces through the engine's image path, then n greedy tokens."""
    full, media = QwenImages(QwenImageSettings(**SETTINGS), image_token_id=PAD).expand(ids, images)
    features, cache = ImageFeatures(model), model.make_cache(1)
    for start in range(0, len(full), CHUNK):
        end = min(start + CHUNK, len(full))
        cache.rope_deltas = [media.delta_after(start)]
        out = model.forward(mx.array([full[start:end]]), cache, media=features.chunk(media, start, end))
    cache.rope_deltas = [media.delta_after(len(full))]
    first = model.logits(out.hidden)[:, -1]
    return _decode(lambda t: model(mx.array([[t]]), cache)[:, -1], first, n)


def mlx_vlm_greedy(model, ids: list[int], images: tuple[bytes, ...], n: int):  # noqa: ANN001
    from mlx_vlm.models.qwen3_vl.processing_qwen3_vl import Qwen3VLImageProcessor

    processed = Qwen3VLImageProcessor(**SETTINGS)([Image.open(io.BytesIO(b)) for b in images])
    grid = mx.array(processed["image_grid_thw"])
    merge = 4
    full: list[int] = []
    counts = iter(int(np.prod(g)) // merge for g in processed["image_grid_thw"])
    for t in ids:
        full += [PAD] * next(counts) if t == PAD else [t]
    cache = model.language_model.make_cache()
    pixels = mx.array(processed["pixel_values"])
    first = model(mx.array([full]), pixels, cache=cache, image_grid_thw=grid).logits[:, -1]
    return _decode(lambda t: model.language_model(mx.array([[t]]), cache=cache).logits[:, -1], first, n)


def _decode(step, logits: mx.array, n: int) -> tuple[list[int], list[mx.array]]:  # noqa: ANN001
    tokens, rows = [], []
    for _ in range(n):
        rows.append(logits[0])
        tokens.append(int(mx.argmax(logits[0]).item()))
        logits = step(tokens[-1])
    mx.eval(rows)
    return tokens, rows


@pytest.mark.parametrize("kind", QWEN_KINDS)
@pytest.mark.parametrize(
    ("ids", "images"), [(ONE_IMAGE, IMAGES[:1]), (TWO_IMAGES, IMAGES)], ids=["one", "two"]
)
def test_qwen_image_prompt_matches_mlx_vlm(kind, ids, images):
    ours, ref = build_ours(kind), build_mlx_vlm(kind)
    got, got_rows = ours_greedy(ours, ids, images, 32)
    want, want_rows = mlx_vlm_greedy(ref, ids, images, 32)
    assert got == want
    assert len(set(got)) > 4  # a real continuation, not one token repeated
    assert max(mx.abs(a - b).max().item() for a, b in zip(got_rows, want_rows, strict=True)) < 1e-4


def test_qwen_preprocessing_matches_mlx_vlm():
    from mlx_vlm.models.qwen3_vl.processing_qwen3_vl import Qwen3VLImageProcessor

    images = (*IMAGES, png(200, 90, 3), png(9, 70, 4))  # downscaled, upscaled, elongated
    processed = Qwen3VLImageProcessor(**SETTINGS)([Image.open(io.BytesIO(b)) for b in images])
    ids = [t for _ in images for t in (START, PAD, END)]
    _, media = QwenImages(QwenImageSettings(**SETTINGS), image_token_id=PAD).expand(ids, images)
    assert [list(s.grid) for s in media.images] == processed["image_grid_thw"].tolist()
    assert np.array_equal(np.concatenate([s.pixels for s in media.images]), processed["pixel_values"])


def test_qwen_rope_positions_match_mlx_vlm():
    ref = build_mlx_vlm("qwen3_5")
    full, media = QwenImages(QwenImageSettings(**SETTINGS), image_token_id=PAD).expand(TWO_IMAGES, IMAGES)
    grid = mx.array([list(s.grid) for s in media.images])
    positions, deltas = ref.language_model.get_rope_index(mx.array([full]), grid)
    assert np.array_equal(np.asarray(positions)[:, 0], media.positions)
    assert media.delta_after(len(full)) == deltas.item() < 0  # images take fewer positions than tokens


def test_parity_detects_a_wrong_image_feature():
    """Negative control: a perturbed tower weight on our side only must change the logits."""
    ours, ref = build_ours("qwen3_5"), build_mlx_vlm("qwen3_5")
    ours.vision_tower.merger.linear_fc2.bias = ours.vision_tower.merger.linear_fc2.bias + 0.5
    _, got = ours_greedy(ours, ONE_IMAGE, IMAGES[:1], 1)
    _, want = mlx_vlm_greedy(ref, ONE_IMAGE, IMAGES[:1], 1)
    assert mx.abs(got[0] - want[0]).max().item() > 1e-3


# -- Nemotron-H vision-language (mlx-vlm's nemotron_h_nano_omni) --------------------------------
NEMO = token_ids("nemotron")
NEMO_IMAGE = NEMO["<image>"]
NEMO_ONE = [3, 17, NEMO_IMAGE, 42, 99, 7]
NEMO_TWO = [3, 17, NEMO_IMAGE, 42, 99, NEMO_IMAGE, 7, 8, 9]
NEMO_IMAGES = (png(50, 30, 1), png(24, 40, 2))  # downscaled to 40x24 (6x10 patches), kept as is


def _nemotron_weights() -> tuple[dict, dict]:
    from kapitsa.testing.tiny_vision import nemotron_vl_config

    config = nemotron_vl_config(tiny.tiny_config("nemotron_h"), NEMO)
    return config, tiny.tiny_weights(config)


def _nemotron_prompter():
    from kapitsa.engine.vision.nemotron import NemotronImages, NemotronImageSettings
    from kapitsa.testing.tiny_vision import nemotron_preprocessor_config

    settings = NemotronImageSettings.from_config(nemotron_preprocessor_config(_nemotron_weights()[0]))
    return NemotronImages(settings, image_id=NEMO_IMAGE, start_id=NEMO["<img>"], end_id=NEMO["</img>"])


def build_ours_nemotron():
    config, hf = _nemotron_weights()
    module = get_model_module(config["model_type"])
    model = module.Model(module.ModelArgs.from_dict(config))
    model.load_weights(list(model.sanitize({k: mx.array(v) for k, v in hf.items()}).items()), strict=True)
    mx.eval(model.parameters())
    return model


def build_mlx_vlm_nemotron():
    from mlx_vlm.models import nemotron_h_nano_omni

    config, hf = _nemotron_weights()
    model = nemotron_h_nano_omni.Model(nemotron_h_nano_omni.ModelConfig.from_dict(config))
    # as mlx_vlm.utils.load does: the model's sanitize, then the language model's
    weights = model.language_model.sanitize(model.sanitize({k: mx.array(v) for k, v in hf.items()}))
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    return model


def nemotron_greedy(model, ids: list[int], images: tuple[bytes, ...], n: int, *, ours: bool):  # noqa: ANN001
    """Ours: prefill in CHUNK-token pieces through the engine's image path; mlx-vlm: one forward
    with the same pixels (its processor's equality is tested below)."""
    full, media = _nemotron_prompter().expand(ids, images)
    if not ours:
        cache = model.language_model.make_cache()
        pixels = [mx.array(s.pixels) for s in media.images]
        first = model(mx.array([full]), pixels, cache=cache).logits[:, -1]
        return _decode(lambda t: model.language_model(mx.array([[t]]), cache=cache).logits[:, -1], first, n)
    features, cache = ImageFeatures(model), model.make_cache(1)
    for start in range(0, len(full), CHUNK):
        end = min(start + CHUNK, len(full))
        out = model.forward(mx.array([full[start:end]]), cache, media=features.chunk(media, start, end))
    first = model.logits(out.hidden)[:, -1]
    return _decode(lambda t: model(mx.array([[t]]), cache)[:, -1], first, n)


@pytest.mark.parametrize(
    ("ids", "images"), [(NEMO_ONE, NEMO_IMAGES[:1]), (NEMO_TWO, NEMO_IMAGES)], ids=["one", "two"]
)
def test_nemotron_image_prompt_matches_mlx_vlm(ids, images):
    ours, ref = build_ours_nemotron(), build_mlx_vlm_nemotron()
    got, got_rows = nemotron_greedy(ours, ids, images, 32, ours=True)
    want, want_rows = nemotron_greedy(ref, ids, images, 32, ours=False)
    assert got == want
    assert len(set(got)) > 4
    assert max(mx.abs(a - b).max().item() for a, b in zip(got_rows, want_rows, strict=True)) < 1e-4


def test_nemotron_preprocessing_matches_mlx_vlm():
    from mlx_vlm.models.nemotron_h_nano_omni import NemotronHNanoOmniImageProcessor

    images = (*NEMO_IMAGES, png(200, 90, 3), png(9, 70, 4), png(8, 8, 5))  # down, up, elongated, tiny
    prompter = _nemotron_prompter()
    s = prompter.settings
    reference = NemotronHNanoOmniImageProcessor(
        norm_mean=list(s.norm_mean), norm_std=list(s.norm_std), patch_size=s.patch_size,
        downsample_ratio=s.downsample_ratio, min_num_patches=s.min_num_patches,
        max_num_patches=s.max_num_patches, max_model_len=s.max_model_len,
    )  # fmt: skip
    for data in images:
        want = reference([Image.open(io.BytesIO(data)).convert("RGB")])
        full, media = prompter.expand([NEMO_IMAGE], (data,))
        span = media.images[0]
        assert span.length == want["num_tokens"][0]
        assert full == [NEMO["<img>"], *[NEMO_IMAGE] * span.length, NEMO["</img>"]]
        assert np.abs(span.pixels - np.asarray(want["pixel_values"])[0]).max() < 1e-5
