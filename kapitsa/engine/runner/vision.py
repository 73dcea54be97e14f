"""Image features for prefill chunks: the vision tower's output per image, kept by pixel digest so a
conversation that re-sends an image encodes it once, and cut to the chunk being prefilled."""

from __future__ import annotations

from collections import OrderedDict

import mlx.core as mx

from kapitsa.engine.models.media import MediaChunk
from kapitsa.engine.vision.media import ImageSpan, PromptMedia

FEATURE_CACHE_BYTES = 256 * 1024 * 1024


class ImageFeatures:
    """Owned by the engine thread, like the model.

    Args:
        model: a model with `encode_image(pixels, grid)` (a vision-language model).
        max_bytes: features kept for reuse (least recently used go first).
    """

    def __init__(self, model, *, max_bytes: int = FEATURE_CACHE_BYTES) -> None:  # noqa: ANN001
        self.model = model
        self.max_bytes = max_bytes
        self._kept: OrderedDict[bytes, mx.array] = OrderedDict()
        self._bytes = 0
        self.num_encoded = 0  # images that went through the tower (tests read it)

    def features(self, span: ImageSpan) -> mx.array:
        """`[span.length, hidden]` features of one image, encoded now or reused."""
        hit = self._kept.get(span.digest)
        if hit is not None:
            self._kept.move_to_end(span.digest)
            return hit
        rows = self.model.encode_image(mx.array(span.pixels), span.grid)
        mx.eval(rows)
        self.num_encoded += 1
        if rows.shape[0] != span.length:
            raise ValueError(f"the vision tower made {rows.shape[0]} features for {span.length} image tokens")
        self._keep(span.digest, rows)
        return rows

    def chunk(self, media: PromptMedia, start: int, end: int) -> MediaChunk | None:
        """What the prefill of prompt tokens [start, end) needs; None when they hold no image token."""
        spans = media.spans_in(start, end)
        if not spans:
            return None
        index, rows = [], []
        for span in spans:
            lo, hi = max(start, span.start), min(end, span.end)
            rows.append(self.features(span)[lo - span.start : hi - span.start])
            index.extend(range(lo - start, hi - start))
        positions = None if media.positions is None else mx.array(media.positions[:, None, start:end])
        return MediaChunk(mx.array(index, dtype=mx.int32), mx.concatenate(rows), positions)

    def _keep(self, digest: bytes, rows: mx.array) -> None:
        if rows.nbytes > self.max_bytes:
            return
        self._kept[digest] = rows
        self._bytes += rows.nbytes
        while self._bytes > self.max_bytes:
            _, old = self._kept.popitem(last=False)
            self._bytes -= old.nbytes
