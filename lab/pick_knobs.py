"""Pick the MLX setting under which kapitsa decoded fastest in `h200_all.sh knobs`' log.

    python lab/pick_knobs.py knobs.log > /tmp/kapitsa-knobs.env

Reads the summary lines (`{"knob": SETTING, "summary": ...}`) and prints `export NAME=VALUE` for
the setting with the best kapitsa decode (with or without fused norms), or nothing when the
default is best or the others do not beat it by MARGIN (a 4B decode moves by a few percent from
run to run on that machine).
"""

from __future__ import annotations

import json
import sys

MARGIN = 1.03


def best_decode(summary: dict) -> float:
    """The fastest kapitsa figure of a summary line: the default or any in-process variant."""
    return max(v for k, v in summary.items() if k.startswith("kapitsa") and k.endswith("_decode") and v)


def pick(lines: list[str]) -> str | None:
    """The winning setting ("NAME=VALUE"), or None for the default."""
    scores: dict[str, float] = {}
    for line in lines:
        if not line.startswith("{"):
            continue
        row = json.loads(line)
        if "summary" in row and "knob" in row:
            scores[row["knob"]] = best_decode(row)
    if "default" not in scores:
        return None  # nothing to compare with (a run that timed out keeps the default)
    default = scores["default"]
    knob, score = max(scores.items(), key=lambda item: item[1])
    return knob if knob != "default" and score > MARGIN * default else None


def main() -> None:
    with open(sys.argv[1], encoding="utf-8") as f:
        knob = pick(f.read().splitlines())
    if knob:
        print(f"export {knob}")


if __name__ == "__main__":
    main()
