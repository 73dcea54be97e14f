"""The default speculation (`--speculative auto`) against plain decoding, on text where drafts fail
and on text where they pay, per shape, in one process.

    python lab/spec_default.py --shapes 27b 4b 35b-a3b nemotron-30b-a3b [--tokens 256] [--rounds 2]
    python lab/spec_default.py --tiny          # a smoke run on any machine

Workloads (greedy, batch 1):
- `own`: the random-weight model's own output after a prompt of prose: whatever it writes, the
  n-gram drafter may or may not find copies in it; nothing is scripted.
- `essay`: the model scripted (spec_shapes.script_model) to write a long passage of English prose
  (the Python reference's "Naming and binding"), where drafts mostly fail.
- `edit`: spec_shapes.py's edit workload, where copying pays; mlx-lm's plain decoding runs beside
  it for the ratio.

Engines: kapitsa plain (`--speculative none`), kapitsa's default speculation as `kapitsa serve`
builds it (factory.strategy_for("auto"): its verify cost curve timed on the model), and the same
with `tree=True` (n-gram tries)
and with `--draft-tokens 7` (drafts no longer than before a GPU's long drafts) on the edit workload. Interleaved rounds; each speculative run must write what plain decoding
writes (`same_as_plain`). The summary gives auto / plain per workload and the edit's ratio to
mlx-lm; tokens per verify and acceptance for the chain and the tree.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
from pathlib import Path

import mlx.core as mx

from kapitsa.engine.speculative.decoder import SpeculativeStats
from kapitsa.engine.speculative.factory import strategy_for
from kapitsa.engine.text.tokenizer import Tokenizer
from kapitsa.testing.tiny import tiny_config
from lab import models_under_test
from lab.engine_timing import DEFAULTS, emit, generate, kapitsa_engine, time_mlxlm
from lab.models_under_test import DTYPE, SHAPES, TINY
from lab.spec_shapes import DEMO, edit_workload, script_model


def essay_workload() -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids): asked to explain name binding, the answer is the reference's text."""
    import pydoc_data.topics as topics

    text = topics.topics["naming"]
    tokenizer = Tokenizer.from_folder(DEMO)
    messages = [{"role": "user", "content": "Explain how Python binds names, in the reference's words."}]
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return prompt, tokenizer.encode(text)


def _timed(
    model, prompt: list[int], tokens: int, mode: str, tree: bool = False, draft_tokens: int | None = None
) -> dict:
    strategy = strategy_for(mode, target_model=model, tree=tree, kernels=DEFAULTS, draft_tokens=draft_tokens)
    client = kapitsa_engine(model, len(prompt), tokens, strategy)
    try:
        generate(client, prompt, tokens)  # warm-up: compiles what the timed run meets
        if isinstance(getattr(strategy, "stats", None), SpeculativeStats):
            strategy.stats = SpeculativeStats()
        result = generate(client, prompt, tokens)
    finally:
        client.close()
    stats = getattr(strategy, "stats", None)
    if stats is not None:
        result.update(
            max_draft=strategy.max_draft,
            verifies=stats.steps,
            pipeline_exits=stats.pipeline_exits,
            tokens_per_verify=round(stats.tokens_per_step, 3),
            acceptance=round(stats.acceptance_rate, 3),
        )
    return result


def _rounds(shape: str, workload: str, runs: dict, rounds: int, reference: list[int] | None) -> list[dict]:
    rows = []
    plain_ids = reference
    for rnd in range(rounds):
        # odd rounds run the engines in reverse order: a drift in the machine's speed (clocks, a
        # neighbour) then weighs on every engine alike instead of on the one that always runs last
        order = list(runs.items()) if rnd % 2 == 0 else list(runs.items())[::-1]
        for engine, run in order:
            result = run()
            ids = result.pop("ids", None)
            if engine == "plain" and plain_ids is None:
                plain_ids = ids
            if ids is not None and plain_ids is not None:
                result["same_as_plain"] = ids == plain_ids[: len(ids)]
            row = dict(shape=shape, workload=workload, engine=engine, round=rnd, **result)
            rows.append(row)
            emit(row)
    return rows


def bench_shape(
    name: str,
    table: dict,
    rounds: int,
    tokens: int,
    workloads=("own", "essay", "edit"),
    tree: bool = True,
    edit_rounds: int | None = None,
) -> list[dict]:
    edit_rounds = rounds if edit_rounds is None else edit_rounds
    kind, dims = table[name]
    config = tiny_config(kind, **dims)
    vocab = config.get("text_config", config)["vocab_size"]
    model = models_under_test.kapitsa_model(config)
    rows: list[dict] = []
    try:
        essay_prompt, essay = essay_workload()
        own = lambda mode: _timed(model, essay_prompt, tokens, mode)  # noqa: E731
        if "own" in workloads:
            runs = {"plain": lambda: own("none"), "auto": lambda: own("auto")}
            rows += _rounds(name, "own", runs, rounds, None)
        edit_prompt, edit = edit_workload()
        if max(essay_prompt + essay + edit_prompt + edit) >= vocab:
            raise SystemExit(f"{name}: vocab {vocab} is smaller than the demo tokenizer's ids")
        n = min(tokens, len(essay), len(edit))
        mlxlm = models_under_test.mlxlm_model(config) if "edit" in workloads else None
        for workload, (prompt, answer) in (("essay", (essay_prompt, essay)), ("edit", (edit_prompt, edit))):
            if workload not in workloads:
                continue
            unscripted = model.forward, model.logits
            script_model(model, prompt, answer)
            runs = {
                "plain": lambda p=prompt: _timed(model, p, n, "none"),
                "auto": lambda p=prompt: _timed(model, p, n, "auto"),
            }
            if workload == "edit":  # auto's draft length against the one it had before long drafts
                runs["auto-7"] = lambda p=prompt: _timed(model, p, n, "auto", draft_tokens=7)
            if workload == "edit" and tree:
                runs["auto-tree"] = lambda p=prompt: _timed(model, p, n, "auto", tree=True)
            if workload == "edit":
                runs["mlx-lm"] = lambda p=prompt: time_mlxlm(mlxlm, p, n)
            rows += _rounds(name, workload, runs, edit_rounds if workload == "edit" else rounds, list(answer))
            model.forward, model.logits = unscripted
    finally:
        gc.collect()
        mx.clear_cache()
    return rows


def _paired_ratio(rows: list[dict]) -> float | None:
    """The median of each round's auto / plain: the two runs of a round sit side by side in time,
    so a drift of the machine's speed between rounds (on the 4B and Nemotron shapes, more than the
    3% this ratio is read against) falls on both of a pair alike."""
    by_round: dict[int, dict[str, float]] = {}
    for r in rows:
        by_round.setdefault(r["round"], {})[r["engine"]] = r["decode_tok_s"]
    ratios = [p["auto"] / p["plain"] for p in by_round.values() if "auto" in p and "plain" in p]
    return round(statistics.median(ratios), 3) if ratios else None


def summary(rows: list[dict]) -> None:
    for shape, workload in dict.fromkeys((r["shape"], r["workload"]) for r in rows):
        mine = [r for r in rows if (r["shape"], r["workload"]) == (shape, workload)]
        med = {
            e: statistics.median(r["decode_tok_s"] for r in mine if r["engine"] == e)
            for e in dict.fromkeys(r["engine"] for r in mine)
        }
        line = dict(
            summary=f"{shape} {workload}",
            **{f"{e}_tok_s": round(v, 1) for e, v in med.items()},
            auto_vs_plain=round(med["auto"] / med["plain"], 3),
            auto_vs_plain_paired=_paired_ratio(mine),
            all_same_as_plain=all(r.get("same_as_plain", True) for r in mine if r["engine"] != "mlx-lm"),
        )
        for e in ("auto", "auto-7", "auto-tree"):
            last = [r for r in mine if r["engine"] == e]
            if last:
                line[f"{e}_max_draft"] = last[-1].get("max_draft")
                line[f"{e}_tokens_per_verify"] = last[-1]["tokens_per_verify"]
                line[f"{e}_verifies"] = last[-1]["verifies"]
                line[f"{e}_pipeline_exits"] = last[-1].get("pipeline_exits")
        if "mlx-lm" in med:
            line["auto_vs_mlxlm"] = round(med["auto"] / med["mlx-lm"], 2)
            if "auto-tree" in med:
                line["tree_vs_mlxlm"] = round(med["auto-tree"] / med["mlx-lm"], 2)
        print(json.dumps(line), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--edit-rounds", type=int, default=None, help="rounds of the edit workload (default --rounds)"
    )
    ap.add_argument("--workloads", nargs="+", default=["own", "essay", "edit"])
    ap.add_argument("--no-tree", action="store_true", help="the edit workload without the n-gram tree")
    ap.add_argument("--tiny", action="store_true", help="tiny widths: a smoke run on CPU")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    table = SHAPES
    if args.tiny:
        DTYPE["value"] = mx.float32
        table = TINY
    print(f"mlx {mx.__version__} on {mx.default_device()}", flush=True)
    rows = []
    for name in args.shapes:  # each shape's summary as soon as it is done: a cut run keeps them
        shape_rows = bench_shape(
            name, table, args.rounds, args.tokens, tuple(args.workloads), not args.no_tree, args.edit_rounds
        )
        summary(shape_rows)
        rows += shape_rows
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
