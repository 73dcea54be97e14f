"""The widths a verify forward is padded up to, and drafts padded to them."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from kapitsa.engine.runner.sequence import Sequence

# On a GPU every new verify width compiles kernels (templated on their row count) and a trace per
# layer, which cost seconds on a large model's first requests. A verify of 2-8 tokens costs about
# the same as one of 2 there (docs/results.md), so drafts are padded up to one of these widths
# (capped at max_draft + 1): three shapes to compile instead of seven.
GPU_VERIFY_WIDTHS = (2, 4, 8, 16)


def verify_widths(widths: Seq[int], max_draft: int) -> tuple[int, ...]:
    """`widths` as the decoder pads to them: those above 1 and below max_draft + 1, and that one
    (none: no padding)."""
    if not widths:
        return ()
    top = max_draft + 1
    return tuple(sorted({w for w in widths if 1 < w < top} | {top}))


def width_for(width: int, widths: Seq[int]) -> int:
    """The verify width a forward of `width` tokens is padded up to (itself past the widest)."""
    return next((w for w in widths if w >= width), width)


def pad_drafts(sequences: Seq[Sequence], drafts: list[list[int]], widths: Seq[int]) -> list[list[int]]:
    """Every row's draft padded to the batch's verify width (repeating its last token) as far as
    the row's max_tokens allows: equal rows take the compiled chain path, not the ragged one."""
    if not widths:
        return drafts
    width = width_for(1 + max(len(d) for d in drafts), widths)
    padded = []
    for seq, draft in zip(sequences, drafts, strict=True):
        room = seq.max_tokens - len(seq.output_ids) - 1
        fill = draft[-1] if draft else seq.output_ids[-1]
        padded.append(draft + [fill] * max(0, min(width - 1, room) - len(draft)))
    return padded
