"""A prompt's images after preprocessing: where their tokens sit, their pixels, and their positions.

Made on a worker thread from numpy only (MLX arrays belong to the engine thread); the engine turns
each image into features there (runner/vision.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kapitsa.engine.vision.images import key_ids


@dataclass(frozen=True, slots=True, eq=False)
class ImageSpan:
    """One image's run of tokens `[start, start + length)` in the prompt and its model input."""

    start: int
    length: int
    digest: bytes
    pixels: np.ndarray  # what the model's `encode_image` takes (float32)
    grid: tuple[int, int, int] | None = None  # Qwen: (time, height, width) in patches

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass(frozen=True, slots=True, eq=False)
class PromptMedia:
    """The images of one prompt, in order.

    `positions [3, L]`: Qwen3.5-VL's (time, height, width) rope positions of every prompt token
    (None: the model has no positions). `inserted`: (placeholder index in the rendered ids, tokens
    added there), to move positions of the rendered prompt to the expanded one.
    """

    images: tuple[ImageSpan, ...]
    positions: np.ndarray | None = None
    inserted: tuple[tuple[int, int], ...] = ()

    def key_ids(self, ids: list[int]) -> list[int]:
        """`ids` with each image's tokens replaced by stand-ins derived from its pixels."""
        out = list(ids)
        for span in self.images:
            out[span.start : span.end] = key_ids(span.digest, span.length)
        return out

    def delta_after(self, end: int) -> int:
        """Rope position minus token position for the token after the first `end` prompt tokens."""
        if self.positions is None or end == 0:
            return 0
        return int(self.positions[:, :end].max()) + 1 - end

    def expanded(self, pos: int) -> int:
        """Position `pos` of the rendered prompt in the expanded one."""
        return pos + sum(n for at, n in self.inserted if at < pos)

    def spans_in(self, start: int, end: int) -> list[ImageSpan]:
        return [s for s in self.images if s.start < end and s.end > start]

    @property
    def num_image_tokens(self) -> int:
        return sum(s.length for s in self.images)
