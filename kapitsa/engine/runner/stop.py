"""Stop strings that may span token boundaries.

Text arrives in deltas (one per token, after incremental detokenization). A delta's tail that could
still grow into a stop string is held back; it is released once it can no longer match, or at the
end of the generation. The text before a stop string is emitted, the stop string itself never is.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class StopCheck:
    text: str  # safe to emit now
    stop: str | None = None  # the stop string that matched, if any (generation ends)


class StopMatcher:
    """Scans streamed text for the earliest occurrence of any of `stops`."""

    def __init__(self, stops: tuple[str, ...] | list[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._held = ""
        self._max_hold = max((len(s) - 1 for s in self.stops), default=0)

    @property
    def held(self) -> str:
        return self._held

    def feed(self, delta: str) -> StopCheck:
        """Add new text; return what can be emitted and whether a stop string ended the output."""
        if not self.stops:
            return StopCheck(delta)
        text = self._held + delta
        hit = _earliest(text, self.stops)
        if hit is not None:
            index, stop = hit
            self._held = ""
            return StopCheck(text[:index], stop)
        keep = _partial_suffix_len(text, self.stops, self._max_hold)
        self._held = text[len(text) - keep :] if keep else ""
        return StopCheck(text[: len(text) - keep])

    def flush(self) -> str:
        """The held text, at the end of a generation that no stop string ended."""
        text, self._held = self._held, ""
        return text


def _earliest(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for stop in stops:
        index = text.find(stop)
        if index >= 0 and (
            best is None or index < best[0] or (index == best[0] and len(stop) > len(best[1]))
        ):
            best = (index, stop)
    return best


def _partial_suffix_len(text: str, stops: tuple[str, ...], max_hold: int) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    for length in range(min(max_hold, len(text)), 0, -1):
        suffix = text[-length:]
        if any(stop.startswith(suffix) for stop in stops):
            return length
    return 0
