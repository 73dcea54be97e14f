"""Nemotron-H vision-language images: the checkpoint's processor settings, the patch grid each image
gets, the resize and normalization, and the image tokens in the prompt.

Follows mlx-vlm 0.7.10's `nemotron_h_nano_omni` image processor (NVIDIA's reference tiler): one tile
per image whose patch grid keeps the aspect within a patch budget and is even on both sides, a float
bicubic antialiased resize (PyTorch's / Pillow's a = -0.5 kernel, done here in numpy), then
(x / 255 - mean) / std. Each `<image>` the chat template writes becomes `<img>`, one `<image>` per
token (a quarter of the patches), `</img>`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kapitsa.engine.vision.images import DecodedImage, decode_image
from kapitsa.engine.vision.media import ImageSpan, PromptMedia
from kapitsa.errors import CheckpointError, InvalidRequest


@dataclass(frozen=True, slots=True)
class NemotronImageSettings:
    norm_mean: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
    norm_std: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)
    patch_size: int = 16
    downsample_ratio: float = 0.5
    min_num_patches: int = 1024
    max_num_patches: int = 13312
    max_model_len: int = 16384

    @classmethod
    def from_config(cls, raw: dict[str, Any]) -> NemotronImageSettings:
        keys = ("patch_size", "downsample_ratio", "min_num_patches", "max_num_patches", "max_model_len")
        kwargs: dict[str, Any] = {k: raw[k] for k in keys if raw.get(k) is not None}
        for k in ("norm_mean", "norm_std"):
            if isinstance(raw.get(k), list) and len(raw[k]) == 3:
                kwargs[k] = tuple(float(x) for x in raw[k])
        return cls(**kwargs)

    @property
    def factor(self) -> int:
        return int(round(1.0 / self.downsample_ratio))

    def patch_budget(self) -> int:
        """Patches one image may take (the processor's per-image budget)."""
        budget = max((self.max_model_len - 4) * self.factor**2, self.min_num_patches)
        limit = self.max_num_patches if self.max_num_patches and self.max_num_patches > 0 else budget
        return max(min(budget, limit), self.min_num_patches)


def target_patches(height: int, width: int, s: NemotronImageSettings) -> tuple[int, int]:
    """(rows, cols) of patches for an image (mlx-vlm's `_compute_target_patches`)."""
    budget = s.patch_budget()
    rows, cols = round(height / s.patch_size + 0.5), round(width / s.patch_size + 0.5)
    scale = min(math.sqrt(budget / (rows * cols)), 1.0)
    rows, cols = math.floor(scale * rows), math.floor(scale * cols)
    if budget > s.min_num_patches and rows * cols < s.min_num_patches:
        up = math.sqrt(s.min_num_patches / (rows * cols))
        rows, cols = math.ceil(up * rows), math.ceil(up * cols)
    d = s.factor
    if rows % d:
        rows = rows + d - rows % d if (rows + d - rows % d) * cols <= budget else max(d, rows - rows % d)
    if cols % d:
        cols = cols + d - cols % d if rows * (cols + d - cols % d) <= budget else max(d, cols - cols % d)
    return rows, cols


def _cubic(t: np.ndarray, a: float = -0.5) -> np.ndarray:
    at = np.abs(t)
    near = (a + 2.0) * at**3 - (a + 3.0) * at**2 + 1.0
    far = a * at**3 - 5.0 * a * at**2 + 8.0 * a * at - 4.0 * a
    return np.where(at <= 1.0, near, np.where(at < 2.0, far, 0.0)).astype(np.float32)


def _bicubic_aa_taps(n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray]:
    """(indices, weights) `[n_out, taps]` of ATen's `_upsample_bicubic2d_aa` along one axis."""
    scale = n_in / n_out
    support = 2.0 * scale if scale >= 1.0 else 2.0
    taps = math.ceil(support) * 2 + 1
    inv = np.float32(1.0 / scale if scale >= 1.0 else 1.0)
    center = np.float32(scale) * (np.arange(n_out, dtype=np.float32) + np.float32(0.5))
    lo = np.maximum(np.floor(center - np.float32(support) + np.float32(0.5)), 0.0)
    hi = np.minimum(np.floor(center + np.float32(support) + np.float32(0.5)), float(n_in))
    size = np.clip(hi - lo, 0, taps)
    pos = lo[:, None] + np.arange(taps, dtype=np.float32)[None, :]
    w = _cubic((pos - center[:, None] + np.float32(0.5)) * inv)
    w = np.where(pos - lo[:, None] < size[:, None], w, np.float32(0.0))
    total = w.sum(axis=1, keepdims=True)
    w = np.where(total > 0, w / np.maximum(total, np.float32(1e-30)), w).astype(np.float32)
    return np.minimum(pos, n_in - 1).astype(np.int64), w


def resize_bicubic(rgb: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """`[H, W, 3]` float32 resized to `[rows, cols, 3]`, antialiased, values unclipped."""
    iy, wy = _bicubic_aa_taps(rgb.shape[0], rows)
    ix, wx = _bicubic_aa_taps(rgb.shape[1], cols)
    out = (rgb[iy] * wy[:, :, None, None]).sum(axis=1)  # [rows, W, 3]
    return (out[:, ix] * wx[None, :, :, None]).sum(axis=2)


def image_pixels(image: DecodedImage, s: NemotronImageSettings) -> np.ndarray:
    """`[3, rows*P, cols*P]` float32 normalized pixels of one image."""
    rows, cols = target_patches(image.height, image.width, s)
    rgb = image.rgb.astype(np.float32)
    if (rows * s.patch_size, cols * s.patch_size) != (image.height, image.width):
        rgb = resize_bicubic(rgb, rows * s.patch_size, cols * s.patch_size)
    mean = np.array(s.norm_mean, dtype=np.float32)[:, None, None]
    std = np.array(s.norm_std, dtype=np.float32)[:, None, None]
    return np.ascontiguousarray((rgb.transpose(2, 0, 1) / np.float32(255.0) - mean) / std, dtype=np.float32)


class NemotronImages:
    """Turns a rendered Nemotron prompt and its images into the expanded prompt and its `PromptMedia`."""

    placeholder = "<image>"

    def __init__(self, settings: NemotronImageSettings, *, image_id: int, start_id: int, end_id: int) -> None:
        self.settings = settings
        self.image_id, self.start_id, self.end_id = image_id, start_id, end_id

    @classmethod
    def from_checkpoint(
        cls, config: dict[str, Any], preprocessor: dict[str, Any], tokenizer: Any
    ) -> NemotronImages:
        ids = {t: tokenizer.token_to_id(t) for t in ("<image>", "<img>", "</img>")}
        missing = [t for t, i in ids.items() if i is None]
        if missing:
            raise CheckpointError(
                f"the tokenizer of this vision-language checkpoint lacks {', '.join(missing)}"
            )
        image_id = config.get("img_context_token_id", ids["<image>"])
        settings = NemotronImageSettings.from_config(preprocessor)
        return cls(settings, image_id=int(image_id), start_id=ids["<img>"], end_id=ids["</img>"])

    def expand(self, ids: list[int], images: Sequence[bytes]) -> tuple[list[int], PromptMedia]:
        """Each `<image>` placeholder -> `<img>`, that image's tokens, `</img>`.

        Raises:
            InvalidRequest: the placeholders and the images differ in number, or an image is unreadable.
        """
        at = [i for i, t in enumerate(ids) if t == self.image_id]
        if len(at) != len(images):
            raise InvalidRequest(
                f"the prompt has {len(at)} image placeholders for {len(images)} images "
                f"(image tokens such as {self.placeholder} cannot be sent as text)"
            )
        out: list[int] = []
        spans: list[ImageSpan] = []
        inserted: list[tuple[int, int]] = []
        prev = 0
        p, f = self.settings.patch_size, self.settings.factor
        for k, (i, data) in enumerate(zip(at, images, strict=True)):
            image = decode_image(data, index=k)
            pixels = image_pixels(image, self.settings)
            length = (pixels.shape[1] // p) * (pixels.shape[2] // p) // f**2
            out += ids[prev:i] + [self.start_id]
            spans.append(ImageSpan(len(out), length, image.digest, pixels))
            out += [self.image_id] * length + [self.end_id]
            inserted.append((i, length + 1))
            prev = i + 1
        out += ids[prev:]
        return out, PromptMedia(tuple(spans), None, tuple(inserted))
