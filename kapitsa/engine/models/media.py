"""What a prefill chunk of a prompt with images gives the model besides its token ids."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True, slots=True)
class MediaChunk:
    """Image features for the image tokens of one batch-1 chunk, and its multi-axis rope positions.

    `index [n]` (int32) are the chunk positions whose embeddings `rows [n, hidden]` replace, in
    order; `positions [3, 1, T]` are Qwen3.5-VL's (time, height, width) rope positions of every
    token of the chunk, None for models without positions (Nemotron-H) or chunks without images.
    """

    index: mx.array | None = None
    rows: mx.array | None = None
    positions: mx.array | None = None

    def splice(self, embeds: mx.array) -> mx.array:
        """`embeds [1, T, hidden]` with the image tokens' rows replaced by the features."""
        if self.index is None or self.rows is None:
            return embeds
        at = mx.broadcast_to(self.index[None, :, None], (1, self.index.shape[0], embeds.shape[-1]))
        return mx.put_along_axis(embeds, at, self.rows[None].astype(embeds.dtype), axis=1)
