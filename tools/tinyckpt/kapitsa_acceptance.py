"""Draft acceptance through kapitsa's own speculative decoder (MLX), on the shipped demo model.

    .venv/bin/python tools/tinyckpt/kapitsa_acceptance.py [--target PATH] [--block PATH] [--prompts 4] [--tokens 48]

`--target` is the shipped demo by default (the trained Nemotron-H fixture with its MTP head also
works); `--block` adds a DFlash block drafter folder (tools/train_block_drafter.py). Greedy, fixed draft lengths (the adaptive controller off), chat prompts built from held-out
standard-library functions of the Python that runs it. Also checks that every speculative answer is
identical to plain greedy decoding.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kapitsa.engine.inprocess import InProcessEngine  # noqa: E402
from kapitsa.engine.loading.loader import load_model  # noqa: E402
from kapitsa.engine.options import EngineConfig  # noqa: E402
from kapitsa.engine.speculative.decoder import SpeculativeDecode  # noqa: E402
from kapitsa.engine.speculative.dflash import DFlashDrafter, load_dflash  # noqa: E402
from kapitsa.engine.speculative.draft_model import DraftModelDrafter  # noqa: E402
from kapitsa.engine.speculative.mtp import MTPDrafter  # noqa: E402
from kapitsa.engine.speculative.ngram import NGramDrafter  # noqa: E402
from kapitsa.engine.types import GenerationRequest, SamplingParams, TokenEvent  # noqa: E402
from tinyckpt.chats import _prompt_upto_docstring  # noqa: E402
from tinyckpt.corpus import functions_in, read_stdlib, split_files  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def _prompts(count: int) -> list[str]:
    _, held_out = split_files(read_stdlib())
    functions = [fn for f in held_out for fn in functions_in(f, max_lines=20) if fn.docstring]
    step = max(1, len(functions) // count)
    return [
        f"Complete this Python function:\n\n```python\n{_prompt_upto_docstring(fn)}\n```"
        for fn in functions[::step][:count]
    ]


async def _answer(engine: InProcessEngine, prompt: str, tokens: int) -> list[int]:
    request = GenerationRequest(
        messages=({"role": "user", "content": prompt},),
        sampling=SamplingParams(temperature=0.0, max_tokens=tokens),
    )
    ids: list[int] = []
    async for event in engine.generate(request):
        if isinstance(event, TokenEvent):
            ids.extend(event.token_ids)
    return ids


def _run(loaded, decode, prompts: list[str], tokens: int) -> list[list[int]]:
    engine = InProcessEngine.from_loaded(loaded, config=EngineConfig(prefix_cache_bytes=0), decode=decode)
    try:
        return [asyncio.run(_answer(engine, p, tokens)) for p in prompts]
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", type=Path, default=REPO / "kapitsa" / "demo")
    parser.add_argument("--block", type=Path, help="a DFlash block drafter folder for the target")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    target = load_model(args.target)
    draft = load_model(REPO / "tests" / "checkpoints" / "trained" / "qwen35-draft")  # the same tokenizer
    prompts = _prompts(args.prompts)
    plain = _run(target, None, prompts, args.tokens)
    modes = {
        "ngram_k4": lambda: SpeculativeDecode(NGramDrafter, name="ngram", max_draft=4, adaptive=False),
        "draft_k4": lambda: SpeculativeDecode(
            lambda: DraftModelDrafter(draft.model), name="draft", max_draft=4, adaptive=False
        ),
    }
    if getattr(target.model, "mtp", None) is not None:
        for k in (1, 2, 3):
            modes[f"mtp_k{k}"] = lambda k=k: SpeculativeDecode(
                lambda: MTPDrafter(target.model), name="mtp", max_draft=k, adaptive=False
            )
    if args.block is not None:
        block = load_dflash(args.block)
        for k in (3, 7):
            modes[f"block_k{k}"] = lambda k=k: SpeculativeDecode(
                lambda: DFlashDrafter(block, target.model), name="block", max_draft=k, adaptive=False
            )
    results = {}
    for name, make in modes.items():
        decode = make()
        answers = _run(target, decode, prompts, args.tokens)
        stats = decode.stats
        results[name] = {
            "tokens_per_step": round(stats.tokens_per_step, 3),
            "acceptance_rate": round(stats.acceptance_rate, 3),
            "verify_steps": stats.steps,
            "same_as_plain_greedy": answers == plain,
        }
        print(name, json.dumps(results[name]), flush=True)
    summary = {"target": str(args.target), "prompts": len(prompts), "tokens": args.tokens, "results": results}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
