"""The per-shape results table (issue #32's "one commit, all four shapes") from the JSON lines of
`lab/decode_vs_mlxlm.py` (summary rows: decode and prefill per prompt length) and
`lab/batch_sweep.py` (aggregate decode per stream count), as `bash lab/h200_all.sh table` writes them,
and the through-the-server table from `lab/server_bench.py`'s summary lines (`bash lab/h200_all.sh
server` writes one `server-<shape>.log` per shape).

    python lab/results_table.py table-*.log              # markdown on stdout
    python lab/results_table.py table-*.log server-*.log # both tables
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
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


SERVER_ENGINES = ("kapitsa engine", "kapitsa serve", "mlx_lm.server")
PLAIN_SERVE = "kapitsa serve --speculative none"  # lab/server_bench.py --plain-serve


def server_shape(path: Path, records: list[dict]) -> str:
    """The shape a server bench log is for: its report's model (`shape-<name>`), else the checkpoint
    it wrote, else its file name."""
    for r in records:
        for engine in r.get("engines", []):
            model = str(engine.get("model") or "")
            if model.startswith("shape-"):
                return model.removeprefix("shape-")
    written = re.search(r"/shape-(\S+) written in ", path.read_text())  # lab/server_bench.py's first line
    return written[1] if written else path.stem.removeprefix("server-")


def server_rows(path: Path) -> tuple[str, dict] | None:
    """(shape, the bench's summary line with its start-up seconds), or None for another log. A bench
    cut before its summary (by its timeout) gets one from its progress lines (`cut_summary`)."""
    records = rows(path)
    for r in reversed(records):
        if isinstance(r.get("summary"), dict) and "kapitsa serve" in r["summary"]:
            return server_shape(path, records), r
    cut = cut_summary(path.read_text())
    return (server_shape(path, records), cut) if cut else None


# a workload's progress line: "[kapitsa] decode_short: decode_tok_s=145.4 ttft_s=0.42 ..."
_WORKLOAD_LINE = re.compile(r"^\[(?P<who>[^\]]+)\] (?P<workload>\w+): (?P<metrics>\w+=.*)$")
# the bench's metrics per summary key (lab/server_bench.py `summary`)
_SUMMARY_METRICS = {
    "decode_tok_s": ("decode_short", "decode_tok_s"),
    "ttft_s": ("decode_short", "ttft_s"),
    "concurrent_tok_s": ("concurrent_4", "aggregate_tok_s"),
    "replay_mean_ttft_s": ("agent_replay", "mean_ttft_s"),
    "replay_cache_hit_pct": ("agent_replay", "cache_hit_pct"),
    "ttft_cold_s": ("ttft_cold_warm", "ttft_cold_s"),
    "prefill_tok_s": ("prefill", "prefill_tok_s"),
}


def cut_summary(text: str) -> dict | None:
    """The summary line a cut bench would have printed, from what it logged as it went: each
    workload's line, named by the engine running then (`[kapitsa]`: the engine in process; a URL:
    the server that last said it was ready or warmed), with `cut: True`. None without a server's
    workload line (not a server bench, or cut before any server answered)."""
    metrics: dict[str, dict[tuple[str, str], float]] = defaultdict(dict)
    start: dict[str, float] = {}
    server = None
    for line in text.splitlines():
        if " warmed its batch sizes in " in line:  # "kapitsa serve[ --speculative none] warmed ..."
            server, _, seconds = line.partition(" warmed its batch sizes in ")
            key = server.replace("kapitsa serve", "kapitsa_serve").replace(" --speculative none", "_plain")
            start[f"{key}_warmup_s"] = _float(seconds.removesuffix(" s"))
        elif "mlx_lm.server" in line and " ready after " in line:
            server = "mlx_lm.server"
            start["mlx_lm_server_ready_s"] = _float(line.rpartition(" ready after ")[2].removesuffix(" s"))
        elif line.startswith("kapitsa serve ready after "):
            ready = _float(line.removeprefix("kapitsa serve ready after ").removesuffix(" s"))
            start.setdefault("kapitsa_serve_ready_s", ready)  # a --plain-serve's comes second
        elif match := _WORKLOAD_LINE.match(line):
            who = "kapitsa engine" if match["who"] == "kapitsa" else server
            if who is not None:
                for pair in match["metrics"].split():
                    name, _, value = pair.partition("=")
                    if (number := _float(value)) is not None:
                        metrics[who][(match["workload"], name)] = number
    if not any(name != "kapitsa engine" for name in metrics):
        return None
    summary = {
        who: {key: got.get(source) for key, source in _SUMMARY_METRICS.items()}
        for who, got in metrics.items()
    }
    out: dict = {"summary": summary, "cut": True, **{k: v for k, v in start.items() if v is not None}}
    decode = {who: s["decode_tok_s"] for who, s in summary.items()}
    streams = {who: s["concurrent_tok_s"] for who, s in summary.items()}
    if decode.get("kapitsa engine") and decode.get("kapitsa serve"):
        out["server_overhead"] = round(1 - decode["kapitsa serve"] / decode["kapitsa engine"], 4)
    if decode.get("kapitsa serve") and decode.get("mlx_lm.server"):
        out["kapitsa_serve_vs_mlx_lm_server"] = round(decode["kapitsa serve"] / decode["mlx_lm.server"], 3)
    if streams.get("kapitsa serve") and streams.get("mlx_lm.server"):
        out["streams_serve_vs_mlx_lm_server"] = round(streams["kapitsa serve"] / streams["mlx_lm.server"], 3)
    return out


def _float(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None  # "n/a"


def _three(summary: dict, key: str, digits: int) -> str:
    """One metric of the three engines, in process / serve / mlx_lm.server."""
    values = (summary.get(e, {}).get(key) for e in SERVER_ENGINES)
    return " / ".join("-" if v is None else f"{v:.{digits}f}" for v in values)


def server_table(benches: list[tuple[str, dict]], engine_decode: dict[str, float] | None = None) -> str:
    """Per shape: decode, time to first token, 8-stream aggregate and the agent replay's mean time
    to first token, in process / kapitsa serve / mlx_lm.server, and serve against mlx_lm.server;
    serve's decode without speculation where the bench ran it (`--plain-serve`). The overhead is
    serve's decode against the engine's in process: the bench's own, else the table's batch-1
    decode of the shape (`engine_decode`; a 512-token prompt there, ~200 here)."""
    head = [
        "shape",
        "decode tok/s: in process / serve / mlx_lm.server (serve/mlx_lm)",
        "first token s",
        "8 streams tok/s (serve/mlx_lm)",
        "replay mean first token s",
        "serve without speculation: decode / 8 streams",
        "serve overhead",
        "serve ready / warm-up s",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for shape, r in benches:
        s = r["summary"]
        ratio, streams_ratio = (
            r.get("kapitsa_serve_vs_mlx_lm_server"),
            r.get("streams_serve_vs_mlx_lm_server"),
        )
        plain = s.get(PLAIN_SERVE, {})
        cells = [
            shape + (" (cut by its timeout)" if r.get("cut") else ""),
            _three(s, "decode_tok_s", 1) + (f" ({ratio:.2f}x)" if ratio else ""),
            _three(s, "ttft_s", 2),
            _three(s, "concurrent_tok_s", 1) + (f" ({streams_ratio:.2f}x)" if streams_ratio else ""),
            _three(s, "replay_mean_ttft_s", 2),
            f"{_num(plain, 'decode_tok_s')} / {_num(plain, 'concurrent_tok_s')}" if plain else "-",
            _overhead(r, (engine_decode or {}).get(shape)),
            f"{r.get('kapitsa_serve_ready_s', '-')} / {r.get('kapitsa_serve_warmup_s', '-')}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _overhead(bench: dict, table_decode: float | None) -> str:
    if bench.get("server_overhead") is not None:
        return f"{bench['server_overhead'] * 100:.1f}%"
    serve = bench["summary"].get("kapitsa serve", {}).get("decode_tok_s")
    if serve and table_decode:
        return f"{(1 - serve / table_decode) * 100:.1f}% (vs the table)"
    return "-"


def decode_summaries(records: list[dict]) -> dict[str, dict[int, dict]]:
    """Per shape and prompt length, the summary line; where a process ended before writing it,
    the same figures from its timed rounds (`summary_of`)."""
    decode: dict[str, dict[int, dict]] = defaultdict(dict)
    rounds: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for r in records:
        if "summary" in r and "prompt" in r:
            decode[r["summary"]][r["prompt"]] = r
        elif "decode_tok_s" in r and r.get("engine") in ("kapitsa", "mlx-lm") and "prompt" in r:
            rounds[(r["shape"], r["prompt"])].append(r)
    for (shape, prompt), timed in rounds.items():
        if prompt not in decode[shape]:
            decode[shape][prompt] = summary_of(timed)
    return decode


def table(records: list[dict]) -> str:
    decode = decode_summaries(records)
    batch: dict[str, dict[tuple[str, int], dict]] = defaultdict(dict)
    warmup: dict[str, float] = {}  # the idle warm-up's seconds, where the sweep's engine ran one
    for r in records:
        if "streams" in r and "engine" in r and "aggregate_tok_s" in r:
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
            cells.append(_streams_cell(k, m, n))
        extras = [_num(b.get(("kapitsa", n)), "first_burst_extra_s") for n in streams]
        cells.append(" / ".join(extras))
        cells.append(f"{warmup[shape]:.1f}" if shape in warmup else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _streams_cell(kapitsa: dict | None, mlxlm: dict | None, streams: int) -> str:
    """kapitsa's aggregate at `streams` (mlx-lm's), and what the bursts' rows met: rows sent back
    by an out-of-memory step, in the timed burst or the first one. A burst that ran under a limit
    below `streams` (halved after such a step) ran in waves, and its rate is no `streams` figure."""
    k = kapitsa or {}
    limit = k.get("limit")
    if limit is not None and limit < streams:
        cell = f"not measured: ran at most {limit} at once ({_num(mlxlm, 'aggregate_tok_s')})"
    else:
        cell = f"{_num(kapitsa, 'aggregate_tok_s')} ({_num(mlxlm, 'aggregate_tok_s')})"
    if k.get("sent_back"):
        cell += f", {k['sent_back']} rows sent back"
    if k.get("first_burst_sent_back"):
        cell += f", its first burst sent {k['first_burst_sent_back']} rows back"
    return cell


def summary_of(timed: list[dict]) -> dict:
    """A (shape, prompt) summary line's decode and prefill figures from its timed rounds: the medians
    `lab/decode_vs_mlxlm.py` writes (older runs wrote them only after every part had finished)."""

    def median(engine: str, key: str) -> float:
        return statistics.median(r[key] for r in timed if r["engine"] == engine)

    kapitsa, mlxlm = median("kapitsa", "decode_tok_s"), median("mlx-lm", "decode_tok_s")
    return dict(
        kapitsa_decode=round(kapitsa, 1),
        mlxlm_decode=round(mlxlm, 1),
        decode_ratio=round(kapitsa / mlxlm, 2),
        kapitsa_prefill=median("kapitsa", "prefill_tok_s"),
        mlxlm_prefill=median("mlx-lm", "prefill_tok_s"),
    )


def engine_decode(records: list[dict]) -> dict[str, float]:
    """Each shape's kapitsa batch-1 decode after 512 prompt tokens, from the table's summary rows."""
    return {
        shape: by_prompt[512]["kapitsa_decode"]
        for shape, by_prompt in decode_summaries(records).items()
        if by_prompt.get(512, {}).get("kapitsa_decode")
    }


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
    benches = [b for path in args.logs if (b := server_rows(path))]
    others = [p for p in args.logs if not server_rows(p)]
    records = [r for path in others for r in rows(path)]
    if others:
        print(table(records))
    if benches:
        print("\n" + server_table(benches, engine_decode(records)))


if __name__ == "__main__":
    main()
