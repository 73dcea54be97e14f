"""Speculative decoding on the real shapes, against mlx-lm's plain decoding, in one run.

    python bench/spec_shapes.py --shapes 27b 35b-a3b 4b nemotron-30b-a3b [--tokens 256] [--rounds 2]
    python bench/spec_shapes.py --tiny       # a smoke run on any machine

Random weights cannot rewrite a file, so this bench takes the workload's acceptance from the
workload and every cost from the real shape:

- The edit workload is speculative_bench.py's (the model is shown Python code and asked to
  rename `o` to `obj`). Its true answer, the renamed code in a fenced block, and the prompt are
  tokenized with the demo checkpoint's tokenizer and chat template.
- At each step the engine's own n-gram drafter proposes from prompt + the true answer so far, at
  the length the engine's adaptive controller asks for: what it would propose to a model writing
  that answer. The tokens of its draft that match the answer are the tokens such a model accepts.
- `ReplayDrafter` hands the target that many of the target's own greedy tokens (from a plain run
  first), then a token it will reject, padded to the n-gram draft's length. So the target's real
  verify forward accepts exactly what the workload would, and the engine pays the real verify,
  acceptance and rollback costs of this shape.

Greedy speculation must reproduce plain decoding; each run's tokens are compared with the plain
run's (bf16 verify forwards can flip near-ties, reported as `first_difference`).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import inspect
import json
import re
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
from decode_vs_mlxlm import DTYPE, SHAPES, TINY, _kapitsa_model, _mlxlm_model, _time_mlxlm, _Tokenizer

from kapitsa.engine.engine import EngineConfig
from kapitsa.engine.inprocess import InProcessEngine
from kapitsa.engine.speculative.decoder import SpeculativeDecode
from kapitsa.engine.speculative.drafter import Draft
from kapitsa.engine.speculative.ngram import NGramDrafter
from kapitsa.engine.tiny import tiny_config
from kapitsa.engine.tokenizer import Tokenizer
from kapitsa.engine.types import FinishEvent, GenerationRequest, ModelInfo, SamplingParams, TokenEvent

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


class ReplayDrafter:
    """Drafts what the n-gram drafter would for a model writing `answer`, in the target's tokens.

    `greedy` is the target's own plain greedy output for this prompt: the first `a` draft tokens
    come from it (so the target accepts them), where `a` is how many of the n-gram draft match
    the true answer; the token after them is one the target rejects."""

    name = "ngram-replay"

    def __init__(self, prompt: Sequence[int], answer: Sequence[int], greedy: Sequence[int], vocab: int):
        self.prompt, self.answer, self.greedy, self.vocab = list(prompt), list(answer), list(greedy), vocab
        self.ngram = NGramDrafter()

    def propose(self, context: Sequence[int], max_tokens: int) -> Draft:
        done = len(context) - len(self.prompt)  # output tokens committed so far
        room = min(max_tokens, len(self.answer) - done, len(self.greedy) - done)
        if room <= 0:
            return Draft(())
        draft = self.ngram.propose(self.prompt + self.answer[:done], room).tokens
        truth = self.answer[done : done + len(draft)]
        accepted = next((i for i, (d, t) in enumerate(zip(draft, truth, strict=True)) if d != t), len(draft))
        ahead = self.greedy[done : done + len(draft)]
        return Draft(tuple(ahead[:accepted]) + tuple((t + 1) % self.vocab for t in ahead[accepted:]))

    def observe(self, new_tokens: Sequence[int]) -> None:
        pass


def _engine(model, tokens: int, prompt: list[int], decode=None) -> InProcessEngine:
    info = ModelInfo(
        id="bench", family="bench", context_length=len(prompt) + tokens + 16, max_output_tokens=tokens
    )
    return InProcessEngine(
        model,
        _Tokenizer(),
        info,
        eos_token_ids=set(),
        config=EngineConfig(prefix_cache_bytes=0, prefill_chunk=2048),
        decode=decode,
    )


def _generate(client: InProcessEngine, prompt: list[int], tokens: int) -> dict:
    async def run() -> dict:
        ids: list[int] = []
        first = end = None
        request = GenerationRequest(
            prompt_token_ids=tuple(prompt), sampling=SamplingParams(max_tokens=tokens, ignore_eos=True)
        )
        async for event in client.generate(request):
            if isinstance(event, TokenEvent):
                ids += event.token_ids
                first = first or time.perf_counter()
            elif isinstance(event, FinishEvent):
                end = time.perf_counter()
        return dict(ids=ids, decode_tok_s=(len(ids) - 1) / max(end - first, 1e-9))

    return asyncio.run(run())


def _time_spec(model, prompt, answer, greedy, vocab, tokens, max_draft) -> dict:
    strategy = SpeculativeDecode(
        lambda: ReplayDrafter(prompt, answer, greedy, vocab), name="ngram-replay", max_draft=max_draft
    )
    client = _engine(model, tokens, prompt, strategy)
    try:
        _generate(client, prompt, tokens)  # warm-up: compiles every verify length it meets
        strategy.stats.__init__()
        result = _generate(client, prompt, tokens)
    finally:
        client.close()
    ids = result.pop("ids")
    diff = next((i for i, (a, b) in enumerate(zip(ids, greedy, strict=False)) if a != b), None)
    return dict(
        result,
        tokens_per_step=round(strategy.stats.tokens_per_step, 3),
        acceptance=round(strategy.stats.acceptance_rate, 3),
        first_difference=diff,
    )


def _time_plain(model, prompt, tokens) -> dict:
    client = _engine(model, tokens, prompt)
    try:
        _generate(client, prompt, 8)
        return _generate(client, prompt, tokens)
    finally:
        client.close()


def bench_shape(name: str, table: dict, rounds: int, tokens: int, max_draft: int) -> list[dict]:
    kind, dims = table[name]
    config = tiny_config(kind, **dims)
    vocab = config.get("text_config", config)["vocab_size"]
    prompt, answer = edit_workload()
    if max(prompt + answer) >= vocab:
        raise SystemExit(f"{name}: vocab {vocab} is smaller than the demo tokenizer's ids")
    tokens = min(tokens, len(answer))
    models = {"mlx-lm": _mlxlm_model(config), "kapitsa": _kapitsa_model(config)}
    greedy = _time_plain(models["kapitsa"], prompt, tokens)["ids"]
    rows = []
    for rnd in range(rounds):
        runs = {
            "kapitsa-plain": lambda: _time_plain(models["kapitsa"], prompt, tokens),
            "kapitsa-spec": lambda: _time_spec(
                models["kapitsa"], prompt, answer, greedy, vocab, tokens, max_draft
            ),
            "mlx-lm": lambda: _time_mlxlm(models["mlx-lm"], prompt, tokens),
        }
        for engine, run in runs.items():
            result = run()
            result.pop("ids", None)
            row = dict(shape=name, engine=engine, round=rnd, prompt=len(prompt), tokens=tokens, **result)
            rows.append(row)
            print(json.dumps(row), flush=True)
    models.clear()
    gc.collect()
    mx.clear_cache()
    return rows


def summary(rows: list[dict]) -> None:
    for shape in dict.fromkeys(r["shape"] for r in rows):
        med = {
            engine: statistics.median(
                r["decode_tok_s"] for r in rows if (r["shape"], r["engine"]) == (shape, engine)
            )
            for engine in ("kapitsa-plain", "kapitsa-spec", "mlx-lm")
        }
        spec = [r for r in rows if (r["shape"], r["engine"]) == (shape, "kapitsa-spec")]
        print(
            json.dumps(
                dict(
                    summary=shape,
                    kapitsa_spec=round(med["kapitsa-spec"], 1),
                    kapitsa_plain=round(med["kapitsa-plain"], 1),
                    mlxlm=round(med["mlx-lm"], 1),
                    spec_vs_mlxlm=round(med["kapitsa-spec"] / med["mlx-lm"], 2),
                    spec_vs_plain=round(med["kapitsa-spec"] / med["kapitsa-plain"], 2),
                    tokens_per_step=spec[-1]["tokens_per_step"],
                    first_difference=[r["first_difference"] for r in spec],
                )
            ),
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--tokens", type=int, default=256, help="at most the true answer's length")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-draft", type=int, default=8)
    ap.add_argument("--tiny", action="store_true", help="tiny widths: a smoke run on CPU")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    table = SHAPES
    if args.tiny:
        DTYPE["value"] = mx.float32
        table = {k: (kind, {"vocab_size": 8192}) for k, (kind, _) in TINY.items()}
    print(f"mlx {mx.__version__} on {mx.default_device()}", flush=True)
    rows = []
    for name in args.shapes:
        rows += bench_shape(name, table, args.rounds, args.tokens, args.max_draft)
    summary(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
