"""Speculative decoding on the real shapes, against mlx-lm's plain decoding, in one run.

    python lab/spec_shapes.py --shapes 27b 35b-a3b 4b nemotron-30b-a3b [--tokens 256] [--rounds 2]
    python lab/spec_shapes.py --tiny       # a smoke run on any machine

Random weights cannot rewrite a file, so the target is made to: `script_model` adds one op after
the model's logits that sets the logit of the edit's true answer at each position to 1e4, so the
target's greedy output is that answer while every forward still runs the whole real-shape model.
The workload is speculative_bench.py's edit (the model is shown Python code and asked to rename
`o` to `obj`); its true answer is the renamed code in a fenced block; prompt and answer are
tokenized with the demo checkpoint's tokenizer and chat template.

Speculation then runs exactly as it does for a real model writing that answer: the engine's own
n-gram drafter and adaptive draft length, the real verify forward, acceptance and rollback of this
shape. kapitsa's plain decoding runs the scripted model too (the same extra op); mlx-lm runs the
unscripted model (its cost does not depend on which tokens it picks). Greedy speculation must
write exactly what plain decoding writes; each run is checked (`same_as_plain`).
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import re
import statistics
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx

from kapitsa.engine.options import KernelOptions
from kapitsa.engine.speculative.decoder import SpeculativeDecode, SpeculativeStats
from kapitsa.engine.speculative.factory import DEFAULT_MAX_DRAFT
from kapitsa.engine.speculative.ngram import NGramDrafter
from kapitsa.engine.text.tokenizer import Tokenizer
from kapitsa.testing.tiny import tiny_config
from lab import models_under_test
from lab.engine_timing import DEFAULTS, emit, generate, kapitsa_engine, time_mlxlm
from lab.models_under_test import DTYPE, SHAPES, TINY
from lab.variants import Variant, timed_with

DEMO = Path(__file__).resolve().parents[1] / "kapitsa" / "demo"


def edit_workload() -> tuple[list[int], list[int]]:
    """(prompt ids, true answer ids) of the edit workload, in the demo tokenizer."""
    import json.encoder as encoder

    source = inspect.getsource(encoder.py_encode_basestring) + inspect.getsource(
        encoder.JSONEncoder.iterencode
    )
    messages = [
        {
            "role": "user",
            "content": f"Rewrite this code, keeping it the same but renaming `o` to `obj`:\n\n{source}",
        }
    ]
    answer = "```python\n" + re.sub(r"\bo\b", "obj", source) + "```"
    tokenizer = Tokenizer.from_folder(DEMO)
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return prompt, tokenizer.encode(answer)


def script_model(model, prompt: Sequence[int], answer: Sequence[int]) -> None:
    """Make `model` (batch 1) pick `answer` greedily after `prompt`, in place: after each forward,
    the logits row at absolute position p gets 1e4 at token `answer[p + 1 - len(prompt)]` (rows
    past the answer are left alone). Wraps the instance's `forward` and `logits`."""
    script = [-1] * (len(prompt) - 1) + list(answer)  # script[p]: the token position p must predict
    forward, logits = model.forward, model.logits
    last = {}

    def scripted_forward(inputs, cache=None, **kwargs):
        last["end"] = cache.offsets[0] + inputs.shape[1]  # positions [end - T, end) this forward
        return forward(inputs, cache, **kwargs)

    def scripted_logits(hidden):
        out = logits(hidden)
        rows = hidden.shape[-2]  # the last `rows` positions of the latest forward
        wanted = [script[p] if p < len(script) else -1 for p in range(last["end"] - rows, last["end"])]
        hit = mx.arange(out.shape[-1]) == mx.array(wanted, dtype=mx.int32)[:, None]
        return mx.where(hit, mx.array(1e4, out.dtype), out)

    model.forward, model.logits = scripted_forward, scripted_logits


def _time_spec(model, prompt, tokens, max_draft, kernels: KernelOptions = DEFAULTS) -> dict:
    strategy = SpeculativeDecode(NGramDrafter, name="ngram", max_draft=max_draft)
    client = kapitsa_engine(model, len(prompt), tokens, strategy, kernels=kernels)
    try:
        generate(client, prompt, tokens)  # warm-up: compiles every verify length it meets
        strategy.stats = SpeculativeStats()  # count the timed run only
        result = generate(client, prompt, tokens)
    finally:
        client.close()
    return dict(
        result,
        tokens_per_step=round(strategy.stats.tokens_per_step, 3),
        acceptance=round(strategy.stats.acceptance_rate, 3),
    )


def _time_plain(model, prompt, tokens) -> dict:
    client = kapitsa_engine(model, len(prompt), tokens)
    try:
        generate(client, prompt, 8)
        return generate(client, prompt, tokens)
    finally:
        client.close()


def spec_rounds(
    name: str,
    kapitsa_model,
    mlxlm_model,
    vocab: int,
    rounds: int,
    tokens: int,
    max_draft: int,
    variants: dict[str, Variant] | None = None,
):
    """Interleaved rounds of kapitsa plain, kapitsa n-gram speculation (both on the scripted
    model) and mlx-lm plain decoding on the edit workload; rows as dicts. Each of `variants`
    (name: a variant, as variants.py makes them) adds speculation under that setting,
    "kapitsa-spec-<name>", to every round. Leaves the kapitsa model scripted (call last)."""
    prompt, answer = edit_workload()
    if max(prompt + answer) >= vocab:
        raise SystemExit(f"{name}: vocab {vocab} is smaller than the demo tokenizer's ids")
    tokens = min(tokens, len(answer))
    script_model(kapitsa_model, prompt, answer)
    runs = {
        "kapitsa-plain": lambda: _time_plain(kapitsa_model, prompt, tokens),
        "kapitsa-spec": lambda: _time_spec(kapitsa_model, prompt, tokens, max_draft),
        "mlx-lm": lambda: time_mlxlm(mlxlm_model, prompt, tokens),
    }
    for label, variant in (variants or {}).items():
        timer = timed_with(
            variant,
            lambda model, prompt, tokens, warmup=None, kernels=DEFAULTS: _time_spec(
                model, prompt, tokens, max_draft, kernels
            ),
        )
        runs[f"kapitsa-spec-{label}"] = lambda timer=timer: timer(kapitsa_model, prompt, tokens)
    rows = []
    for rnd in range(rounds):
        for engine, run in runs.items():
            result = run()
            if "error" in result:  # a variant that failed: reported, left out of the summary
                emit(dict(shape=name, engine=engine, round=rnd, **result))
                continue
            ids = result.pop("ids", None)
            if ids is not None:
                result["same_as_plain"] = ids == answer[: len(ids)]
            row = dict(shape=name, engine=engine, round=rnd, prompt=len(prompt), tokens=tokens, **result)
            rows.append(row)
            emit(row)
    return rows


def bench_shape(name: str, table: dict, rounds: int, tokens: int, max_draft: int) -> list[dict]:
    kind, dims = table[name]
    config = tiny_config(kind, **dims)
    vocab = config.get("text_config", config)["vocab_size"]
    models = {
        "mlx-lm": models_under_test.mlxlm_model(config),
        "kapitsa": models_under_test.kapitsa_model(config),
    }
    try:
        return spec_rounds(name, models["kapitsa"], models["mlx-lm"], vocab, rounds, tokens, max_draft)
    finally:
        models.clear()
        gc.collect()
        mx.clear_cache()


def summary(rows: list[dict]) -> None:
    for shape in dict.fromkeys(r["shape"] for r in rows):
        engines = dict.fromkeys(r["engine"] for r in rows if r["shape"] == shape)  # variants too
        med = {
            engine: statistics.median(
                r["decode_tok_s"] for r in rows if (r["shape"], r["engine"]) == (shape, engine)
            )
            for engine in engines
        }
        spec = [r for r in rows if (r["shape"], r["engine"]) == (shape, "kapitsa-spec")]
        kapitsa = [r for r in rows if r["shape"] == shape and r["engine"].startswith("kapitsa")]
        variants = {
            e.removeprefix("kapitsa-spec-"): tok_s
            for e, tok_s in med.items()
            if e.startswith("kapitsa-spec-")
        }
        print(
            json.dumps(
                dict(
                    summary=f"{shape} edit speculation",
                    kapitsa_spec=round(med["kapitsa-spec"], 1),
                    kapitsa_plain=round(med["kapitsa-plain"], 1),
                    mlxlm=round(med["mlx-lm"], 1),
                    spec_vs_mlxlm=round(med["kapitsa-spec"] / med["mlx-lm"], 2),
                    spec_vs_plain=round(med["kapitsa-spec"] / med["kapitsa-plain"], 2),
                    tokens_per_step=spec[-1]["tokens_per_step"],
                    all_wrote_the_answer=all(r["same_as_plain"] for r in kapitsa),
                    **{f"kapitsa_spec_{v}": round(tok_s, 1) for v, tok_s in variants.items()},
                    **{
                        f"spec_{v}_vs_mlxlm": round(tok_s / med["mlx-lm"], 2) for v, tok_s in variants.items()
                    },
                )
            ),
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--tokens", type=int, default=256, help="at most the true answer's length")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-draft", type=int, default=DEFAULT_MAX_DRAFT)
    ap.add_argument("--tiny", action="store_true", help="tiny widths: a smoke run on CPU")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    table = SHAPES
    if args.tiny:
        DTYPE["value"] = mx.float32
        table = TINY
    print(f"mlx {mx.__version__} on {mx.default_device()}", flush=True)
    rows = []
    for name in args.shapes:
        rows += bench_shape(name, table, args.rounds, args.tokens, args.max_draft)
    summary(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
