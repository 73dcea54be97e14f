"""Images in API requests: OpenAI chat `image_url`, Responses `input_image` and Anthropic `image` parts
become `{"type": "image"}` parts for the chat template, and their bytes `GenerationRequest.images`,
in the order the parts come.

Translation leaves an unresolved image part (`image_part`); `take_images` then refuses images to a
text-only model before reading any, and resolves the rest: `data:` URLs and base64 sources decode,
`file://` URLs read a local file, and `http(s)` URLs are refused (the server fetches nothing).
"""

from __future__ import annotations

import base64
import binascii
import os
import stat
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from kapitsa.engine.types import ModelInfo
from kapitsa.errors import InvalidRequest

IMAGE_PART_TYPES = ("image_url", "input_image", "image")
MAX_IMAGE_BYTES = 20 * 1024 * 1024  # per image, encoded (the Anthropic API's own limit is lower)
MAX_IMAGES = 64  # per request
_SOURCE = "_kapitsa_image"  # key of an unresolved part: (part type, "url" | "base64", value)
TOOL_IMAGE_OMITTED = "[an image: the served model reads text only, so it is left out]"


def is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES


def image_part(part: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI (`image_url`, `input_image`) or Anthropic (`image`) part, unresolved."""
    kind = part["type"]
    if kind == "image":
        source = part.get("source")
        if not isinstance(source, dict):
            raise InvalidRequest("An `image` block needs a `source` object.")
        if source.get("type") == "base64" and isinstance(source.get("data"), str):
            return {"type": "image", _SOURCE: (kind, "base64", source["data"])}
        if source.get("type") == "url" and isinstance(source.get("url"), str):
            return {"type": "image", _SOURCE: (kind, "url", source["url"])}
        raise InvalidRequest("An `image` block's source must be base64 `data` or a `url`.")
    url = part.get("image_url")
    if isinstance(url, dict):
        url = url.get("url")
    if not isinstance(url, str) or not url:
        raise InvalidRequest(f"An `{kind}` part needs an image URL (`data:` or `file://`).")
    return {"type": "image", _SOURCE: (kind, "url", url)}


def content_parts(content: list[Any], text_of: Any) -> str | list[dict[str, Any]]:
    """A content list with image parts as template parts: texts (joined by newlines between images)
    and unresolved images in order. `text_of(parts)` flattens the text-only runs."""
    out: list[dict[str, Any]] = []
    run: list[Any] = []
    for part in content:
        if not is_image_part(part):
            run.append(part)
            continue
        if run:
            out.append({"type": "text", "text": text_of(run)})
            run = []
        out.append(image_part(part))
    if run:
        out.append({"type": "text", "text": text_of(run)})
    return out


def take_images(
    messages: list[dict[str, Any]], model: ModelInfo
) -> tuple[list[dict[str, Any]], tuple[bytes, ...]]:
    """The messages with every image part resolved to `{"type": "image"}`, and the images' bytes.

    Raises:
        InvalidRequest: images for a text-only model, too many, or one that cannot be read.
    """
    images: list[bytes] = []
    out = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list) or not any(isinstance(p, dict) and _SOURCE in p for p in content):
            out.append(message)
            continue
        parts = []
        for part in content:
            if isinstance(part, dict) and _SOURCE in part:
                if message.get("role") == "tool" and not model.vision:
                    # an agent's tool returned it (a screenshot, Codex's view_image): the turn goes on,
                    # and the model reads that the image was there
                    part = {"type": "text", "text": TOOL_IMAGE_OMITTED}
                else:
                    images.append(_resolve(*part[_SOURCE], model=model, index=len(images)))
                    part = {"type": "image"}
            parts.append(part)
        out.append({**message, "content": _joined_texts(parts)})
    if len(images) > MAX_IMAGES:
        raise InvalidRequest(f"A request may carry at most {MAX_IMAGES} images; this one has {len(images)}.")
    return out, tuple(images)


def _joined_texts(parts: list[Any]) -> str | list[Any]:
    """Parts that are all text again (a text-only model's tool images replaced) as one string."""
    if all(isinstance(p, dict) and p.get("type") == "text" for p in parts):
        return "\n".join(str(p.get("text", "")) for p in parts)
    return parts


def _resolve(kind: str, how: str, value: str, *, model: ModelInfo, index: int) -> bytes:
    if not model.vision:
        raise InvalidRequest(f"`{kind}` content is not supported: the served model reads text only.")
    data = _decode_base64(value, index) if how == "base64" else _read_url(value, index)
    if len(data) > MAX_IMAGE_BYTES:
        raise InvalidRequest(f"Image {index + 1} is {len(data)} bytes; at most {MAX_IMAGE_BYTES} are read.")
    return data


def _read_url(url: str, index: int) -> bytes:
    if url.startswith("data:"):
        header, sep, payload = url[5:].partition(",")
        if not sep or not header.endswith(";base64"):
            raise InvalidRequest(
                f"Image {index + 1}: a data: URL must be base64 (`data:image/png;base64,...`)."
            )
        return _decode_base64(payload, index)
    parsed = urlparse(url)
    if parsed.scheme in ("http", "https"):
        raise InvalidRequest(
            f"Image {index + 1}: kapitsa does not fetch images from the network ({parsed.scheme}:// URL); "
            "send it as a data: URL (base64) or a file:// path on this machine."
        )
    if parsed.scheme != "file" or parsed.netloc not in ("", "localhost"):
        raise InvalidRequest(f"Image {index + 1}: unsupported image URL; use a data: URL or a file:// path.")
    return _read_file(Path(unquote(parsed.path)), index)


def _read_file(path: Path, index: int) -> bytes:
    """A regular file's bytes, at most MAX_IMAGE_BYTES of them: a FIFO, a device (/dev/zero) or a
    file that grows while it is read never holds the request."""
    try:  # O_NONBLOCK: opening a FIFO without a writer returns at once instead of waiting for one
        with os.fdopen(os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)), "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise InvalidRequest(f"Image {index + 1}: {path} is not a regular file.")
            data = f.read(MAX_IMAGE_BYTES + 1)
    except OSError as err:
        raise InvalidRequest(f"Image {index + 1}: cannot read {path}: {err.strerror or err}.") from err
    if len(data) > MAX_IMAGE_BYTES:
        raise InvalidRequest(f"Image {index + 1} ({path}) is larger than {MAX_IMAGE_BYTES} bytes.")
    return data


def _decode_base64(payload: str, index: int) -> bytes:
    try:
        return base64.b64decode("".join(payload.split()), validate=True)  # line-wrapped base64 too
    except (binascii.Error, ValueError) as err:
        raise InvalidRequest(f"Image {index + 1} is not valid base64: {err}.") from err
