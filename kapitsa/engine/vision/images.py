"""Decoding the images a request sends (Pillow) and the digest that keys them in the prefix cache."""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass

import numpy as np

from kapitsa.errors import InvalidRequest

MAX_IMAGE_PIXELS = 64_000_000  # a bigger image is refused before it is decoded (decompression bombs)


@dataclass(frozen=True, slots=True)
class DecodedImage:
    rgb: np.ndarray  # [H, W, 3] uint8
    digest: bytes  # 32 bytes of blake2b over the pixels and their shape

    @property
    def height(self) -> int:
        return int(self.rgb.shape[0])

    @property
    def width(self) -> int:
        return int(self.rgb.shape[1])


def decode_image(data: bytes, *, index: int = 0) -> DecodedImage:
    """An encoded image (PNG, JPEG, WebP, GIF's first frame...) as RGB pixels.

    Raises:
        InvalidRequest: the bytes are not an image Pillow reads, or it is far too large.
    """
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            if image.width * image.height > MAX_IMAGE_PIXELS:
                raise InvalidRequest(
                    f"image {index + 1} is {image.width}x{image.height} pixels; at most {MAX_IMAGE_PIXELS} are read"
                )
            rgb = np.asarray(image.convert("RGB"))
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as err:
        raise InvalidRequest(f"image {index + 1} could not be decoded: {err}") from err
    return DecodedImage(rgb, pixel_digest(rgb))


def pixel_digest(rgb: np.ndarray) -> bytes:
    h = hashlib.blake2b(digest_size=32)
    h.update(np.asarray(rgb.shape, dtype=np.int64).tobytes())
    h.update(np.ascontiguousarray(rgb).tobytes())
    return h.digest()


def key_ids(digest: bytes, count: int) -> list[int]:
    """Stand-ins for an image's `count` tokens in prefix-cache keys: negative (no real token has
    them), int32 (the disk tier stores keys so), and cycling through the digest's eight words, so
    two images share a key only if their digests do."""
    words = np.frombuffer(digest, dtype="<u4").astype(np.int64)
    return [int(-1 - (words[i % len(words)] & 0x7FFFFFFF)) for i in range(count)]
