"""Qwen3.5 / Qwen3.6 images: the checkpoint's processor settings, resizing, patching, the image
tokens in the prompt and the multi-axis rope positions.

Follows mlx-vlm 0.7.10 (`qwen3_vl/processing_qwen3_vl.py`, `qwen3_5/language.py`): `smart_resize`
to multiples of patch x merge within [min_pixels, max_pixels], a bicubic Pillow resize, rescale and
normalize, the image repeated over `temporal_patch_size`, patches in merge-block order. Each
`<|image_pad|>` the chat template writes becomes `t*h*w / merge^2` of them; positions are text
positions, then (t, h, w) grid positions from where the image starts, then text again from one past
the image's largest position.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kapitsa.engine.vision.images import DecodedImage, decode_image
from kapitsa.engine.vision.media import ImageSpan, PromptMedia
from kapitsa.errors import InvalidRequest


@dataclass(frozen=True, slots=True)
class QwenImageSettings:
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 14 * 14 * 4 * 1280
    rescale_factor: float = 1 / 255.0
    do_rescale: bool = True
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    @classmethod
    def from_configs(cls, preprocessor: dict[str, Any], processor: dict[str, Any]) -> QwenImageSettings:
        """From preprocessor_config.json (and processor_config.json's `image_processor`), as mlx-vlm reads them."""
        raw = {**preprocessor, **(processor.get("image_processor") or {})}
        keys = (
            "patch_size",
            "temporal_patch_size",
            "merge_size",
            "rescale_factor",
            "do_rescale",
            "do_normalize",
        )
        kwargs: dict[str, Any] = {k: raw[k] for k in keys if k in raw}
        for k in ("image_mean", "image_std"):
            if isinstance(raw.get(k), list) and len(raw[k]) == 3:
                kwargs[k] = tuple(float(x) for x in raw[k])
        size = raw.get("size") or {}
        for name, key in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
            value = raw.get(name, size.get(key))
            if value is not None:
                kwargs[name] = int(value)
        return cls(**kwargs)


def smart_resize(
    height: int, width: int, *, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """The size an image is resized to: multiples of `factor`, about the same aspect, within the pixel bounds."""
    if max(height, width) / min(height, width) > 200:
        raise InvalidRequest(f"an image of {width}x{height} pixels is too elongated (aspect ratio over 200)")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    if not h_bar or not w_bar:
        raise InvalidRequest(f"an image of {width}x{height} pixels is too small for the vision tower")
    return h_bar, w_bar


def image_patches(image: DecodedImage, s: QwenImageSettings) -> tuple[np.ndarray, tuple[int, int, int]]:
    """`[t*h*w, C*T*P*P]` float32 patches and the (t, h, w) patch grid of one image."""
    from PIL import Image

    height, width = smart_resize(
        image.height,
        image.width,
        factor=s.patch_size * s.merge_size,
        min_pixels=s.min_pixels,
        max_pixels=s.max_pixels,
    )
    rgb = image.rgb
    if (height, width) != (image.height, image.width):
        rgb = np.asarray(Image.fromarray(rgb).resize((width, height), resample=Image.BICUBIC))
    pixels = rgb.transpose(2, 0, 1).astype(np.float32)  # [C, H, W]
    if s.do_rescale:
        pixels = pixels * np.float32(s.rescale_factor)
    if s.do_normalize:
        mean = np.array(s.image_mean, dtype=np.float32)[:, None, None]
        std = np.array(s.image_std, dtype=np.float32)[:, None, None]
        pixels = (pixels - mean) / std
    ps, tps, ms = s.patch_size, s.temporal_patch_size, s.merge_size
    gh, gw = height // ps, width // ps
    frames = np.repeat(pixels[None, None], tps, axis=1)  # [1, T, C, H, W]
    frames = frames.reshape(1, 1, tps, 3, gh // ms, ms, ps, gw // ms, ms, ps)
    frames = frames.transpose(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    return np.ascontiguousarray(frames.reshape(gh * gw, 3 * tps * ps * ps)), (1, gh, gw)


def rope_positions(ids: Sequence[int], spans: Sequence[ImageSpan], merge_size: int) -> np.ndarray:
    """`[3, len(ids)]` int32 (time, height, width) positions (mlx-vlm's `get_rope_index`, one row)."""
    out = np.empty((3, len(ids)), dtype=np.int64)
    next_pos, at = 0, 0
    for span in spans:
        text = span.start - at
        out[:, at : span.start] = next_pos + np.arange(text)
        t, h, w = span.grid[0], span.grid[1] // merge_size, span.grid[2] // merge_size
        base = next_pos + text
        out[0, span.start : span.end] = base + np.repeat(np.arange(t), h * w)
        out[1, span.start : span.end] = base + np.tile(np.repeat(np.arange(h), w), t)
        out[2, span.start : span.end] = base + np.tile(np.arange(w), t * h)
        next_pos, at = base + max(t, h, w), span.end
    out[:, at:] = next_pos + np.arange(len(ids) - at)
    return out.astype(np.int32)


class QwenImages:
    """Turns a rendered Qwen prompt and its images into the expanded prompt and its `PromptMedia`."""

    placeholder = "<|image_pad|>"

    def __init__(self, settings: QwenImageSettings, *, image_token_id: int) -> None:
        self.settings = settings
        self.image_token_id = image_token_id

    def expand(self, ids: list[int], images: Sequence[bytes]) -> tuple[list[int], PromptMedia]:
        """Each image placeholder token -> that image's run of tokens.

        Raises:
            InvalidRequest: the placeholders and the images differ in number, or an image is unreadable.
        """
        at = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(at) != len(images):
            raise InvalidRequest(
                f"the prompt has {len(at)} image placeholders for {len(images)} images "
                f"(image tokens such as {self.placeholder} cannot be sent as text)"
            )
        out: list[int] = []
        spans: list[ImageSpan] = []
        inserted: list[tuple[int, int]] = []
        prev = 0
        merge = self.settings.merge_size**2
        for k, (i, data) in enumerate(zip(at, images, strict=True)):
            image = decode_image(data, index=k)
            pixels, grid = image_patches(image, self.settings)
            length = grid[0] * grid[1] * grid[2] // merge
            out += ids[prev:i]
            spans.append(ImageSpan(len(out), length, image.digest, pixels, grid))
            out += [self.image_token_id] * length
            inserted.append((i, length - 1))
            prev = i + 1
        out += ids[prev:]
        positions = rope_positions(out, spans, self.settings.merge_size)
        return out, PromptMedia(tuple(spans), positions, tuple(inserted))
