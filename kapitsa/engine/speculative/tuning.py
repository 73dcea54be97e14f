"""The draft shape (chain or tree, and how many draft tokens) that pays best for one model on one
machine: `kapitsa bench --tune-speculation` measures the candidates and writes the fastest here,
and the opener reads it when neither `--tree` nor `--draft-tokens` is given.

Which shape pays depends on the shape of the model and the backend: a dense model's verify of up
to 16 tokens costs one read of the weights on a GPU (trees and long chains are cheap), a MoE
verify routes to more experts as it widens, and on the CPU a small model's verify costs about T
decode steps. So it is measured, per model and backend, not guessed.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

TUNING_FILE = "speculation-tuning.json"


@dataclass(slots=True, frozen=True)
class DraftShape:
    tree: bool
    draft_tokens: int

    @property
    def label(self) -> str:
        return f"{'tree' if self.tree else 'chain'} {self.draft_tokens}"


@dataclass(slots=True, frozen=True)
class Tuning:
    """What the bench kept: the fastest shape, and whether it beat plain decoding at all (when
    not, `--speculative auto` decodes plainly on this model and machine)."""

    shape: DraftShape
    pays: bool


# What the bench tries: short and long chains (the controller shortens a chain when acceptance
# drops, so the longest is a cap), and trees of the default and a wider budget.
CANDIDATES = (DraftShape(False, 3), DraftShape(False, 7), DraftShape(True, 7), DraftShape(True, 11))


def tuning_key(model_id: str, backend: str | None) -> str:
    return f"{model_id}@{backend or 'cpu'}"


def fastest(measured: dict[DraftShape, float]) -> DraftShape:
    """The candidate with the highest decode tok/s (ties: the first measured)."""
    if not measured:
        raise ValueError("no draft shape was measured")
    return max(measured, key=lambda shape: measured[shape])


def read_tuning(path: Path, key: str) -> Tuning | None:
    """The tuning recorded for `key`, or None when nothing usable is recorded (a missing, unreadable
    or hand-broken file means untuned, never an error at start-up)."""
    try:
        entry = json.loads(path.read_text())[key]
        shape = DraftShape(tree=bool(entry["tree"]), draft_tokens=int(entry["draft_tokens"]))
        pays = bool(entry.get("pays", True))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return Tuning(shape, pays) if 1 <= shape.draft_tokens <= 32 else None


def write_tuning(
    path: Path, key: str, tuning: Tuning, measured: dict[DraftShape, float], plain_tok_s: float
) -> None:
    """Record `tuning` for `key`, keeping the other models' entries; atomic and private (0600)."""
    try:
        entries = json.loads(path.read_text())
        if not isinstance(entries, dict):
            entries = {}
    except (OSError, ValueError):
        entries = {}
    entries[key] = {
        "tree": tuning.shape.tree,
        "draft_tokens": tuning.shape.draft_tokens,
        "pays": tuning.pays,
        "decode_tok_s": {"plain": round(plain_tok_s, 2)}
        | {s.label: round(v, 2) for s, v in measured.items()},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as out:
            json.dump(entries, out, indent=1, sort_keys=True)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
