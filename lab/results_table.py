"""The per-shape results table (issue #32's "one commit, all four shapes") from the JSON lines of
`lab/decode_vs_mlxlm.py` (summary rows: decode and prefill per prompt length) and
`lab/batch_sweep.py` (aggregate decode per stream count), as `bash lab/h200_all.sh table` writes them.

    python lab/results_table.py table.log            # markdown on stdout
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def rows(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        start = line.find("{")
        if start < 0:
            continue
        try:
            out.append(json.loads(line[start:]))
        except json.JSONDecodeError:
            continue
    return out


def table(records: list[dict]) -> str:
    decode: dict[str, dict[int, dict]] = defaultdict(dict)
    batch: dict[str, dict[tuple[str, int], dict]] = defaultdict(dict)
    warmup: dict[str, float] = {}  # the idle warm-up's seconds, where the sweep's engine ran one
    for r in records:
        if "summary" in r and "prompt" in r:
            decode[r["summary"]][r["prompt"]] = r
        elif "streams" in r and "engine" in r and "aggregate_tok_s" in r:
            batch[r["shape"]][(r["engine"], r["streams"])] = r
        elif "warmup_s" in r:
            warmup[r["shape"]] = r["warmup_s"]
    shapes = list(dict.fromkeys([*decode, *batch]))
    streams = sorted({n for b in batch.values() for _, n in b})
    prompts = sorted({p for d in decode.values() for p in d})
    head = ["shape", "decode tok/s (mlx-lm, x)", f"prefill tok/s at {' / '.join(map(str, prompts))} (mlx-lm)"]
    head += [f"{n} streams (mlx-lm)" for n in streams]
    head += [f"first-burst compile s at {' / '.join(map(str, streams))} streams", "idle warm-up s"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for shape in shapes:
        d = decode.get(shape, {})
        short = d.get(512) or next(iter(d.values()), None)
        cells = [shape, _decode(short), _prefill(d)]
        b = batch.get(shape, {})
        for n in streams:
            k, m = b.get(("kapitsa", n)), b.get(("mlx-lm", n))
            cells.append(f"{_num(k, 'aggregate_tok_s')} ({_num(m, 'aggregate_tok_s')})")
        extras = [_num(b.get(("kapitsa", n)), "first_burst_extra_s") for n in streams]
        cells.append(" / ".join(extras))
        cells.append(f"{warmup[shape]:.1f}" if shape in warmup else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _decode(r: dict | None) -> str:
    if r is None:
        return "-"
    return f"{r['kapitsa_decode']} ({r['mlxlm_decode']}, {r['decode_ratio']}x)"


def _prefill(by_prompt: dict[int, dict]) -> str:
    parts = [f"{r['kapitsa_prefill']:.0f} ({r['mlxlm_prefill']:.0f})" for _, r in sorted(by_prompt.items())]
    return " / ".join(parts) or "-"


def _num(r: dict | None, key: str) -> str:
    return "-" if r is None or r.get(key) is None else f"{r[key]:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("logs", nargs="+", type=Path)
    args = parser.parse_args()
    print(table([r for path in args.logs for r in rows(path)]))


if __name__ == "__main__":
    main()
